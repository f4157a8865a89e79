"""The generation path shared by both dialects: submit, bridge outputs to asyncio, relay or collect.

The engine calls `on_output` from its own thread; `EngineStream` hands each output to
the event loop with `loop.call_soon_threadsafe` and an asyncio.Queue. Leaving the
`with` block before the request finished (client gone, write failed, handler cancelled)
cancels it in the engine, which frees its KV blocks on the next step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from aiohttp import web

from gpushare.api.context import context
from gpushare.api.errors import ApiError, bad_request
from gpushare.api.metrics import record_for_stream
from gpushare.protocol.request import (EngineFailed, GenerationRequest, ModelLimits, RequestError, check_request,
                                     model_limits, tenant_limit_bytes)
from gpushare.protocol.sampling_params import SamplingParams
from gpushare.protocol.outputs import RequestOutput

log = logging.getLogger("gpushare.api")
# A stream's kernel send buffer. Left to autotuning it grows to net.ipv4.tcp_wmem's maximum (4 MiB,
# some 18,000 chunks): a client that stops reading would then stall no write, and hold its tenant
# slot, until its whole answer had been generated. Token streams need little: 256 KiB is seconds of
# output even on a slow link.
STREAM_SEND_BUFFER_BYTES = 256 << 10


class EngineStream:
    """One request submitted to the engine; iterate it for RequestOutputs (of its ``n`` answers,
    interleaved, ``index`` telling them apart) until all have finished or one failed."""

    def __init__(self, engine, request: GenerationRequest):
        self._engine = engine
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.finished = False
        self._unfinished = request.params.n
        self._record = record_for_stream(request.model, request.tenant)  # the request's metrics (api/metrics.py)
        try:
            self.request_id = engine.submit(request, self._on_output)
        except ValueError as e:
            raise bad_request(str(e)) from None
        except EngineFailed as e:
            raise engine_failed(e) from None
        except KeyError:  # unloaded between the lease and the submit: only while the daemon stops
            raise ApiError(503, f'model "{request.model}" was unloaded; retry', retry_after_s=1) from None

    def _on_output(self, out: RequestOutput) -> None:  # engine thread
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, out)
        except RuntimeError:  # the loop is closed: the daemon is shutting down
            pass

    def __enter__(self) -> EngineStream:
        return self

    def __exit__(self, *exc) -> None:
        if not self.finished:
            self._engine.cancel(self.request_id)

    def __aiter__(self) -> EngineStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        out = await self._queue.get()
        self._unfinished -= out.finished
        self.finished = self._unfinished == 0 or out.finish_reason in ("error", "abort", "rejected")
        if self._record is not None:
            self._record.observe(out)
        return out


@dataclass
class Timings:
    """Ollama's durations, from the daemon's monotonic clock (seconds here, nanoseconds on the wire)."""
    start_s: float = field(default_factory=time.monotonic)
    load_s: float = 0.0
    submit_s: float | None = None
    first_token_s: float | None = None
    end_s: float | None = None
    prompt_tokens: int = 0
    generated_tokens: int = 0

    generated_by_answer: dict = field(default_factory=dict)  # n > 1: answer index -> its tokens

    def observe(self, out: RequestOutput) -> None:
        self.prompt_tokens = out.num_prompt_tokens or self.prompt_tokens
        self.generated_by_answer[out.index] = out.num_generated_tokens
        self.generated_tokens = sum(self.generated_by_answer.values())
        if out.first_token_time_s is not None:
            self.first_token_s = out.first_token_time_s
        if out.finished:
            self.end_s = time.monotonic()

    def ollama_fields(self) -> dict:
        end = self.end_s or time.monotonic()
        submit = self.submit_s or self.start_s
        first = self.first_token_s or end
        ns = 1_000_000_000
        return {
            "total_duration": int((end - self.start_s) * ns),
            "load_duration": int(self.load_s * ns),
            "prompt_eval_count": self.prompt_tokens,
            "prompt_eval_duration": int(max(first - submit, 0.0) * ns),
            "eval_count": self.generated_tokens,
            "eval_duration": int(max(end - first, 0.0) * ns),
        }


def lease_limits(lease, tenant: str, policies: dict | None = None) -> tuple[ModelLimits, int | None]:
    """The leased model's limits from its engine's latest snapshot, and the tenant's node-wide kv_limit
    in bytes (`policies`: the node's tenant policies; None: the engine's own)."""
    device = lease.device
    stats = device.stats()
    model_stats = stats.models.get(lease.entry.engine_name)  # an adapter's: its base's
    if model_stats is None:  # unloaded between the lease and now: only while the daemon stops or a worker died
        raise ApiError(503, f'model "{lease.entry.name}" was unloaded; retry', retry_after_s=1)
    config = lease.model.config
    limits = model_limits(config.context_length, config.vocab_size, model_stats, stats.max_num_seqs)
    return limits, tenant_limit_bytes(device.tenant_policies if policies is None else policies, tenant, limits)


def checked_request(lease, prompt_ids: list[int], params: SamplingParams, tenant: str, priority: str | None,
                    num_ctx: int | None = None, clip: bool = False, field_names: dict[str, str] | None = None,
                    policies: dict | None = None, fair_group: str = "") -> GenerationRequest:
    """The one GenerationRequest for this request, its max_tokens fixed by protocol/request.check_request
    (the one max_tokens rule); 400 naming what is wrong (and the field, as ``field_names`` calls it in
    the dialect) when it can never run."""
    limits, tenant_bytes = lease_limits(lease, tenant, policies)
    try:
        fixed = check_request(prompt_ids, params, limits, num_ctx=num_ctx, tenant_limit_bytes=tenant_bytes,
                              tenant=tenant, priority=priority, clip=clip)
    except RequestError as e:
        raise bad_request(str(e), param=(field_names or {}).get(e.field, e.field)) from None
    return GenerationRequest(lease.entry.name, prompt_ids, replace(params, max_tokens=fixed.max_tokens), tenant,
                             priority, fair_group=fair_group)


def make_sampling_params(field_names: dict[str, str] | None = None, **kwargs) -> SamplingParams:
    """SamplingParams from already type-checked values (None = the engine default); 400 on a bad range,
    naming the field as the client wrote it (``field_names`` maps engine names onto the dialect's)."""
    params = SamplingParams(**{k: v for k, v in kwargs.items() if v is not None})
    try:
        params.validate()
    except ValueError as e:
        name, _, rest = str(e).partition(" ")  # validate() starts each message with the field's name
        shown = (field_names or {}).get(name, name)
        raise bad_request(f'"{shown}" {rest}', param=shown) from None
    return params


def engine_failed(e: EngineFailed) -> ApiError:
    """503: the engine loop failed for good; only a restart brings it back."""
    return ApiError(503, f"the engine is down: {e}", code="engine_failed")


def finish_error(out: RequestOutput) -> ApiError | None:
    """The error a finished output carries, if it did not end normally."""
    if out.finish_reason == "error":
        return ApiError(500, out.error or "the engine failed this request")
    if out.finish_reason == "rejected":  # the engine refused it as sent (its grammar did not compile)
        return ApiError(400, out.error or "the engine refused this request")
    if out.finish_reason == "abort":  # unloaded, the daemon stopping, or its engine worker died
        return ApiError(503, out.error or "the request was cancelled: its model was unloaded or the daemon is "
                        "stopping", retry_after_s=1)
    return None


@dataclass
class Answer:
    """One of a request's answers, collected whole."""
    index: int
    text: str = ""
    logprobs: list = field(default_factory=list)  # TokenLogprobs of its tokens, when asked for
    out: RequestOutput | None = None  # its final output


async def collect(stream: EngineStream, timings: Timings) -> list[Answer]:
    """Run a request to the end; its answers in index order. Raises ApiError on failure."""
    answers: dict[int, Answer] = {}
    parts: dict[int, list[str]] = {}
    async for out in stream:
        timings.observe(out)
        answer = answers.setdefault(out.index, Answer(out.index))
        parts.setdefault(out.index, []).append(out.text)
        answer.logprobs += out.logprobs or []
        if out.finished:
            err = finish_error(out)
            if err is not None:
                raise err
            answer.out = out
            answer.text = "".join(parts[out.index])
    if not answers or any(a.out is None for a in answers.values()):
        raise AssertionError("the engine stream ended without a finished output")
    return [answers[i] for i in sorted(answers)]


@dataclass
class StreamFormat:
    """How one dialect frames a token stream: NDJSON lines (Ollama) or server-sent events (OpenAI)."""
    sse: bool
    piece: Callable[[RequestOutput], list[dict]]  # the chunks for an output's new text (and logprobs)
    tail: Callable[[RequestOutput], list[dict]]  # the chunks after an answer's last text
    error: Callable[[ApiError], dict]
    head: Callable[[], list[dict]] = list  # the chunks before the first text
    end: Callable[[], list[dict]] = list  # the chunks after every answer finished
    typed_events: bool = False  # SSE events named by each chunk's "type", no "data: [DONE]" (Anthropic, Responses)
    ping: Callable[[], dict] | None = None  # sent when no output came for PING_INTERVAL_S


PING_INTERVAL_S = 10.0


class _Pinged:
    """The stream's outputs, and None each time PING_INTERVAL_S passes without one (without cancelling
    the wait for the next output: a cancelled queue read could lose it)."""

    def __init__(self, stream: EngineStream, pinging: bool):
        self.stream, self.pinging, self.next = stream, pinging, None

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.pinging or self.stream.finished:
            return await self.stream.__anext__()
        if self.next is None:
            self.next = asyncio.ensure_future(self.stream.__anext__())
        done, _ = await asyncio.wait({self.next}, timeout=PING_INTERVAL_S)
        if not done:
            return None
        task, self.next = self.next, None
        return task.result()

    def close(self) -> None:
        if self.next is not None:
            self.next.cancel()


def _stream_response(request: web.Request, fmt: StreamFormat) -> web.StreamResponse:
    """The response a stream goes out on, its socket's send buffer small (a client that stops reading
    fills it soon, and server.write_timeout then applies)."""
    sock = request.transport.get_extra_info("socket") if request.transport is not None else None
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_SEND_BUFFER_BYTES)
    return web.StreamResponse(headers={"Content-Type": "text/event-stream" if fmt.sse else "application/x-ndjson",
                                       "Cache-Control": "no-cache"})


def _frame(obj: dict, fmt: StreamFormat) -> bytes:
    """One chunk on the wire: a typed SSE event, an SSE data line, or an NDJSON line."""
    data = json.dumps(obj, ensure_ascii=False)
    if fmt.typed_events:
        return f"event: {obj['type']}\ndata: {data}\n\n".encode()
    return (f"data: {data}\n\n" if fmt.sse else data + "\n").encode()


async def relay(request: web.Request, stream: EngineStream, timings: Timings, fmt: StreamFormat) -> web.StreamResponse:
    """Stream a request's outputs to the client as they come.

    Headers go out with the first output, so a request that fails before producing
    anything still gets a plain HTTP error; one that fails later ends its stream with an
    error object, as Ollama does. A client that goes away makes a write fail, and leaving
    the caller's `with EngineStream` then cancels the request. So does a client that stops
    reading: a write that cannot finish within server.write_timeout (the socket's buffers
    stay full) drops the connection, and with it the tenant slot and model lease it held.
    """
    write_timeout_s = context(request).settings.server.write_timeout_s
    response = _stream_response(request, fmt)

    async def send(obj: dict) -> None:
        await asyncio.wait_for(response.write(_frame(obj, fmt)), write_timeout_s)

    failed = False
    outputs = _Pinged(stream, fmt.ping is not None)
    try:
        async for out in outputs:
            if out is None:
                if response.prepared:
                    await send(fmt.ping())
                continue
            timings.observe(out)
            err = finish_error(out) if out.finished else None
            failed = err is not None
            if not response.prepared:
                if err is not None:
                    raise err
                await response.prepare(request)
                for chunk in fmt.head():
                    await send(chunk)
            if err is not None:
                await send(fmt.error(err))
                break
            for chunk in fmt.piece(out):
                await send(chunk)
            if out.finished:
                for chunk in fmt.tail(out):
                    await send(chunk)
        if stream.finished and not failed:
            for chunk in fmt.end():
                await send(chunk)
        if fmt.sse and not fmt.typed_events:
            await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:
        pass  # the client left; the caller's `with EngineStream` cancels the request
    except asyncio.TimeoutError:  # the client stopped reading: drop it, as if it had left
        log.warning("%s %s: the client read nothing for %gs; dropping its stream", request.method, request.path,
                    write_timeout_s)
        if request.transport is not None:
            request.transport.abort()
    finally:
        outputs.close()
    return response
