"""Ollama's HTTP API (/api/*) with Ollama's field names and meanings.

Generation streams NDJSON by default (`"stream": false` for one object); the last chunk
carries done_reason and the durations in nanoseconds. A generate/chat request with no
prompt/messages loads the model (done_reason "load"), or unloads it with keep_alive 0
(done_reason "unload"). Sampling defaults are Ollama's (temperature 0.8, top_k 40,
top_p 0.9) except repeat_penalty, which stays 1.0: Ollama applies it to the last 64
tokens only (repeat_last_n), a window this engine does not have. A model's own options,
system prompt and template (api/model_defaults.py) fill what a request leaves out, and a chat
longer than its context loses its oldest messages as in Ollama. /api/show, /api/create and
/api/copy are in api/ollama_models.py, /api/pull and /api/blobs in api/ollama_pull.py.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import importlib.metadata
import json
import time
from dataclasses import dataclass

from aiohttp import web

from gpushare.api.context import context, encode_text
from gpushare.api.embeddings import check_serves, embed_texts, rows_response, vector_json
from gpushare.api.errors import ApiError, bad_request
from gpushare.api.fields import (field, keep_alive_s, message_list, read_json_object, reject_unsupported,
                                 required_string, string_list)
from gpushare.api.limits import check_prompt_chars, check_stop, limits_of
from gpushare.api.logprobs import TokenText, requested as logprobs_requested
from gpushare.api.model_defaults import (chat_with_presets, context_room, encode_with_template, fit_chat,
                                         with_model_options)
from gpushare.api.streaming import (EngineStream, StreamFormat, Timings, checked_request, collect,
                                    make_sampling_params, relay)
from gpushare.api.structured import ollama_format
from gpushare.api.tenants import admit, check_keep_alive, check_model
from gpushare.api import thinking as think
from gpushare.api.tools import (ToolSpec, encode_chat_with_tools, forced_output, message_tool_fields, parse_calls,
                                parse_tools)
from gpushare.api.turn import ReplyStream, whole_reply
from gpushare.api.work import bounded, budget_of
from gpushare.residency.registry import ModelLoadError, RegistrationError, RegistryFull

LOAD_PROGRESS_INTERVAL_S = 0.1  # /api/load: how often a progress line may be written
FOREVER_S = 292 * 365 * 86400  # Ollama's expires_at for keep_alive < 0

ROLES = {role: role for role in ("system", "user", "assistant", "tool")}
# Options we take, with their Ollama defaults; other Ollama options (num_gpu, mirostat, ...)
# are llama.cpp-specific and ignored.
OLLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
# Engine names of sampling fields -> where an Ollama request sets them (for 400 messages).
FIELD_NAMES = {name: "options." + name for name in ("temperature", "top_k", "top_p", "min_p", "seed", "stop",
                                                    "presence_penalty", "frequency_penalty")}
FIELD_NAMES.update(repetition_penalty="options.repeat_penalty", max_tokens="options.num_predict")
UNSUPPORTED = {
    "images": "is not supported: no vision models",
    "suffix": "(fill-in-the-middle) is not supported",
    "template": "is not supported: the template comes from the model file",
    "context": "is not supported; use /api/chat to continue a conversation",
}


def now_rfc3339() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def rfc3339(epoch_s: float) -> str:
    return dt.datetime.fromtimestamp(epoch_s, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# ---------------------------------------------------------------------------- request parsing

def sampling_from_options(body: dict, limits):
    """SamplingParams from Ollama's `options`; also returns num_ctx (None if unset)."""
    options = field(body, "options", "object", {})
    p = "options."
    num_predict = field(options, "num_predict", "integer", prefix=p)
    values = {
        "temperature": field(options, "temperature", "number", prefix=p),
        "top_k": field(options, "top_k", "integer", prefix=p),
        "top_p": field(options, "top_p", "number", prefix=p),
        "min_p": field(options, "min_p", "number", prefix=p),
        "seed": field(options, "seed", "integer", prefix=p),
        "repetition_penalty": field(options, "repeat_penalty", "number", prefix=p),
        "presence_penalty": field(options, "presence_penalty", "number", prefix=p),
        "frequency_penalty": field(options, "frequency_penalty", "number", prefix=p),
        "stop": string_list(options, "stop", prefix=p),
    }
    check_stop(values["stop"], p + "stop", limits)
    for key, default in OLLAMA_DEFAULTS.items():
        if values[key] is None:
            values[key] = default
    if values["top_k"] is not None and values["top_k"] <= 0:
        values["top_k"] = -1  # Ollama: 0 disables top-k
    num_ctx = field(options, "num_ctx", "integer", prefix=p)
    if num_ctx is not None and num_ctx <= 0:
        raise bad_request(f'"options.num_ctx" must be a positive integer, got {num_ctx}', param="options.num_ctx")
    # num_predict: -1 (or any value <= 0) means no limit but the context, as in Ollama.
    max_tokens = num_predict if num_predict is not None and num_predict > 0 else None
    return values, max_tokens, num_ctx


def _message_content(m: dict, where: str) -> str:
    if m.get("images"):
        raise bad_request(f'"{where}.images" is not supported: no vision models', param=where + ".images")
    return field(m, "content", "string", "", prefix=where + ".")


def parse_messages(body: dict, limits) -> list[dict]:
    return message_list(field(body, "messages", "array", []), ROLES, _message_content, limits, message_tool_fields)


def _tool_calls(calls: list[dict]) -> list[dict]:
    return [{"function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]


# ---------------------------------------------------------------------------- shared flow

async def _load_or_unload(request: web.Request, model: str, keep_alive: float | None, extra: dict) -> web.Response:
    """A generate or chat with no prompt: loads (or unloads) the model. It holds one of the tenant's
    request slots meanwhile, as a generation would: a load is work for the node too."""
    check_model(request, model)
    check_keep_alive(request, keep_alive)
    registry = context(request).registry
    async with admit(request, model):
        if keep_alive == 0:
            try:
                await registry.unload(model)
            except RegistrationError as e:  # a pinned model
                raise bad_request(str(e)) from None
            reason = "unload"
        else:
            await registry.load(model, keep_alive)
            reason = "load"
    return web.json_response({"model": model, "created_at": now_rfc3339(), **extra, "done": True,
                              "done_reason": reason})


async def _generate(request: web.Request, body: dict, model: str, make_prompt, chat: bool,
                    tools: ToolSpec | None = None) -> web.StreamResponse:
    """Run one generation; `make_prompt(loaded_model, preset, room, budget, variables)` -> token ids (room:
    the most tokens the request may hold; budget: its WorkBudget, for the chat template; variables: the
    template's, for thinking), run in the work pool; ``chat``: answer as a message. The model's preset
    options sit under the request's; ``think`` splits a thinking model's reply."""
    sampling_from_options(body, limits_of(request))  # the request's own options: a 400 before a slot is taken
    keep_alive = keep_alive_s(body)
    check_keep_alive(request, keep_alive)
    stream = field(body, "stream", "boolean", True)
    tools = tools or ToolSpec()
    structured = forced_output(tools) or await bounded(request, "checking the format schema", ollama_format, body,
                                                       limits_of(request))
    top_logprobs = logprobs_requested(body)
    asked = think.effort(body.get("think"), "think")
    raw = field(body, "raw", "boolean", False)
    ctx = context(request)
    timings = Timings()
    async with admit(request, model) as ticket, ctx.registry.use(model, keep_alive) as lease:
        check_serves(lease.model, model, "chat")
        preset = lease.entry.source.preset
        values, max_tokens, num_ctx = sampling_from_options(with_model_options(body, preset), limits_of(request))
        num_ctx = num_ctx or ctx.settings.server.context_length
        timings.load_s = lease.load_duration_s
        room = context_room(lease.device, lease.entry.engine_name, lease.model.config.context_length, num_ctx)
        thinking = think.checked(think.Thinking(False, raw=True) if raw else asked, lease.model, preset.template,
                                 model)
        prompt_ids = await bounded(request, "rendering the chat template and tokenising the prompt", make_prompt,
                                   lease.model, preset, room, budget_of(request), think.template_vars(thinking))
        plan = think.plan(thinking, lease.model, preset.template, prompt_ids, structured)
        params = make_sampling_params(FIELD_NAMES, max_tokens=max_tokens, structured=plan.structured,
                                      logprobs=top_logprobs, **values, **plan.sampling)
        # Ollama never fails on num_predict: generation stops at the context (clip).
        gen = checked_request(lease, prompt_ids, params, ticket.tenant, ticket.priority, num_ctx, clip=True,
                              field_names=FIELD_NAMES, policies=ctx.node.tenant_policies,
                              fair_group=ticket.fair_group)
        ticket.charge_tokens(len(prompt_ids) + gen.params.max_tokens, timings)
        lease.hold_tokens(len(prompt_ids) + gen.params.max_tokens)
        timings.submit_s = time.monotonic()
        shape = _Replies(model, chat, plan.shape.thinks, timings,
                         TokenText(lease.model) if top_logprobs is not None else None, top_logprobs)
        with EngineStream(lease.device, gen) as engine_stream:
            if stream:
                return await relay(request, engine_stream, timings, _ndjson(shape, tools, plan.shape))
            answer = (await collect(engine_stream, timings))[0]
            whole = whole_reply(answer.text, tools, plan.shape)
            return web.json_response({**shape.tail(answer.out)[0],
                                      **shape.reply(whole.text, whole.calls, whole.thinking),
                                      **shape.logprobs(answer.logprobs)})


@dataclass
class _Replies:
    """How one generation's answers are shaped: /api/generate's ``response`` or /api/chat's ``message``,
    with thinking, tool calls and logprobs where asked."""
    model: str
    chat: bool
    thinks: bool
    timings: Timings
    token_text: TokenText | None
    top_logprobs: int | None

    def reply(self, text: str, calls: list[dict] | None = None, thought: str | None = None) -> dict:
        shown = {"thinking": thought} if self.thinks and thought is not None else {}
        if not self.chat:
            return {"response": text, **shown}
        return {"message": {"role": "assistant", "content": text, **shown,
                            **({"tool_calls": _tool_calls(calls)} if calls else {})}}

    def logprobs(self, items) -> dict:
        if self.token_text is None:
            return {}
        return {"logprobs": self.token_text.entries(items, self.top_logprobs > 0)}

    def tail(self, out) -> list[dict]:
        return [{"model": self.model, "created_at": now_rfc3339(), **self.reply(""), "done": True,
                 "done_reason": out.finish_reason, **self.timings.ollama_fields()}]

    def line(self, **fields) -> dict:
        return {"model": self.model, "created_at": now_rfc3339(), **self.reply(**fields), "done": False}

    def lines(self, items) -> list[dict]:
        """One NDJSON line per (kind, value) of a ReplyStream: thinking, text or tool calls."""
        by_kind = {"thinking": lambda v: self.line(text="", thought=v), "text": lambda v: self.line(text=v),
                   "calls": lambda v: self.line(text="", calls=v)}
        return [by_kind[kind](value) for kind, value in items if kind in by_kind]


def _ndjson(shape: _Replies, tools: ToolSpec, split: think.ReplyShape) -> StreamFormat:
    """Ollama's stream: a line per piece of thinking, text or tool call, then the closing line."""
    parts = ReplyStream(tools, split)

    def piece(out):
        chunks = shape.lines(parts.feed(out.text))
        if out.logprobs and shape.token_text:
            chunks = chunks or [shape.line(text="")]
            chunks[0].update(shape.logprobs(out.logprobs))
        if out.finished:
            chunks += shape.lines(parts.finish())
            if parts.calls.call is not None:  # Ollama sends a call whole: the streamed one, parsed
                chunks.append(shape.line(text="", calls=parse_calls(parts.answer, tools)))
        return chunks

    return StreamFormat(sse=False, piece=piece, tail=shape.tail, error=lambda err: {"error": err.message})


# ---------------------------------------------------------------------------- handlers

async def root(request: web.Request) -> web.Response:
    return web.Response(text="gpushare is running")


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": importlib.metadata.version("gpushare")})


async def generate(request: web.Request) -> web.StreamResponse:
    body = await read_json_object(request)
    model = required_string(body, "model")
    reject_unsupported(body, {**UNSUPPORTED, "tools": "is not supported on /api/generate; use /api/chat"})
    prompt = field(body, "prompt", "string", "")
    system = field(body, "system", "string", "")
    raw = field(body, "raw", "boolean", False)
    check_prompt_chars((prompt, system), "prompt", limits_of(request))
    if not prompt:
        return await _load_or_unload(request, model, keep_alive_s(body), {"response": ""})

    def make_prompt(loaded, preset, room, budget, variables):
        if raw:
            return encode_text(loaded, prompt)
        messages = chat_with_presets(preset, ([{"role": "system", "content": system}] if system else [])
                                     + [{"role": "user", "content": prompt}])
        return encode_with_template(loaded, messages, preset.template, budget, **variables)

    return await _generate(request, body, model, make_prompt, chat=False)


async def chat(request: web.Request) -> web.StreamResponse:
    body = await read_json_object(request)
    model = required_string(body, "model")
    reject_unsupported(body, UNSUPPORTED)
    limits = limits_of(request)
    messages = await bounded(request, "reading the messages", parse_messages, body, limits)
    tools = await bounded(request, "checking the tools", parse_tools, body, limits, messages)
    if not messages:
        return await _load_or_unload(request, model, keep_alive_s(body),
                                     {"message": {"role": "assistant", "content": ""}})
    truncate = field(body, "truncate", "boolean", True)

    def make_prompt(loaded, preset, room, budget, variables):
        return fit_chat(lambda kept: encode_chat_with_tools(loaded, kept, tools, budget, preset.template, **variables),
                        chat_with_presets(preset, messages), room, truncate)

    return await _generate(request, body, model, make_prompt, chat=True, tools=tools)


async def embed(request: web.Request) -> web.Response:
    body = await read_json_object(request)
    model = required_string(body, "model")
    texts = string_list(body, "input")
    truncate = field(body, "truncate", "boolean", True)
    vectors, t = await embed_texts(request, model, [] if texts == [""] else texts, keep_alive_s(body), truncate,
                                   body.get("dimensions"))
    fields = t.ollama_fields()
    return await rows_response(request, {"model": model, "total_duration": fields["total_duration"],
                                         "load_duration": fields["load_duration"],
                                         "prompt_eval_count": t.prompt_tokens},
                               "embeddings", len(vectors), lambda i: vector_json(vectors[i]))


async def embeddings(request: web.Request) -> web.Response:
    """The legacy single-prompt endpoint."""
    body = await read_json_object(request)
    model = required_string(body, "model")
    prompt = field(body, "prompt", "string", "")
    truncate = field(body, "truncate", "boolean", True)
    vectors, _ = await embed_texts(request, model, [prompt] if prompt else [], keep_alive_s(body), truncate,
                                   body.get("dimensions"))
    return web.json_response({"embedding": vectors[0].tolist() if vectors else []})


async def load(request: web.Request) -> web.StreamResponse:
    """gpushare's own: load a model (as a generate with no prompt) and stream its progress as NDJSON,
    as Ollama's /api/pull does: {"status": "queued"|"loading", "completed": bytes, "total": bytes} lines,
    then {"status": "success", "load_duration": ns, "from": the state before: "loaded", "loading", "warm"
    or "on disk"}, or {"error": ...} once streaming. It holds one of the tenant's request slots meanwhile
    (requests_per_s and max_concurrent count it as a generation)."""
    body = await read_json_object(request)
    model = required_string(body, "model")
    check_model(request, model)
    keep_alive = keep_alive_s(body)
    check_keep_alive(request, keep_alive)
    async with admit(request, model):
        return await _stream_load(request, model, keep_alive)


async def _stream_load(request: web.Request, model: str, keep_alive: float | None) -> web.StreamResponse:
    registry = context(request).registry
    source = registry.find(model)
    name, was = source.name, registry.state(source)
    loading = asyncio.ensure_future(registry.load(model, keep_alive))
    try:
        await asyncio.wait({loading}, timeout=LOAD_PROGRESS_INTERVAL_S)
        if loading.done() and loading.exception() is not None:
            raise loading.exception()  # before the first line: a plain HTTP error (404, 503 + Retry-After)
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        last = None
        while not loading.done():
            job = registry.get_loading(name)
            line = job and {"status": job.state, "completed": job.done_bytes, "total": job.total_bytes}
            if line and line != last:
                await response.write(json.dumps(line).encode() + b"\n")
                last = line
            await asyncio.wait({loading}, timeout=LOAD_PROGRESS_INTERVAL_S)
        try:
            lease = loading.result()
            line = {"status": "success", "model": model, "load_duration": int(lease.load_duration_s * 1e9),
                    "from": was}
        except (ModelLoadError, RegistryFull) as e:
            line = {"error": str(e)}
        await response.write(json.dumps(line).encode() + b"\n")
        await response.write_eof()
        return response
    finally:
        loading.cancel()


async def not_supported(request: web.Request) -> web.Response:
    raise ApiError(501, f"{request.path} is not supported: gpushare pulls models and serves local files, "
                        f"it does not push them")


def add_routes(app: web.Application) -> None:
    app.router.add_get("/", root)
    app.router.add_get("/api/version", version)
    app.router.add_post("/api/generate", generate)
    app.router.add_post("/api/chat", chat)
    app.router.add_post("/api/embed", embed)
    app.router.add_post("/api/embeddings", embeddings)
    app.router.add_post("/api/load", load)
    app.router.add_post("/api/push", not_supported)
