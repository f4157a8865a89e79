"""OpenAI's HTTP API (/v1/*): chat completions, completions, models, embeddings.

Streams are server-sent events ending in ``data: [DONE]``; errors are OpenAI's
``{"error": {"message", "type", "param", "code"}}``. vLLM's extra sampling fields
(top_k, min_p, repetition_penalty, ignore_eos) are accepted. ``n`` answers (``best_of`` may only
equal it) share the prompt's KV blocks; ``response_format`` and forced ``tool_choice`` constrain
decoding; ``logprobs`` come from the logits the sampler used. A thinking model's thinking is
``reasoning_content`` (``reasoning_effort`` sets its budget, vLLM's ``chat_template_kwargs.enable_thinking``
turns it off); a tool call streams as vLLM streams it, its arguments as they are generated.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from aiohttp import web

from gpushare.api.context import context, encode_text
from gpushare.api.embeddings import check_serves, embed_texts, rows_response, vector_base64, vector_json
from gpushare.api.errors import bad_request, error_body
from gpushare.api.fields import (field, message_list, read_json_object, reject_unsupported, required_string,
                                 string_list, text_parts)
from gpushare.api.limits import check_count, check_prompt_chars, check_stop, limits_of
from gpushare.api.logprobs import TokenText, completion_requested, requested as logprobs_requested
from gpushare.api.model_defaults import chat_with_presets, fill_openai_values
from gpushare.api.streaming import (EngineStream, StreamFormat, Timings, checked_request, collect,
                                    make_sampling_params, relay)
from gpushare.api.structured import openai_response_format
from gpushare.api import thinking as think
from gpushare.api.tools import (ToolSpec, encode_chat_with_tools, forced_output, message_tool_fields, new_call_id,
                                parse_tools)
from gpushare.api.turn import ReplyStream, whole_reply
from gpushare.api.tenants import admit, check_model, visible
from gpushare.api.work import bounded, budget_of
from gpushare.residency.registry import ModelLoadError

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
FINGERPRINT = "gpushare"
UNSUPPORTED = ("functions", "logit_bias", "echo", "suffix")


# ---------------------------------------------------------------------------- request parsing

def _answers(body: dict) -> int:
    """``n``, with ``best_of`` allowed only equal to it (every answer is returned; none is ranked)."""
    reject_unsupported(body, {key: "is not supported" for key in UNSUPPORTED})
    n = field(body, "n", "integer", 1)
    if n < 1:
        raise bad_request(f'"n" must be a positive integer, got {n}', param="n")
    best_of = field(body, "best_of", "integer", n)
    if best_of != n:
        raise bad_request(f'"best_of" must equal "n" ({n}): answers are not ranked, got {best_of}', param="best_of")
    return n


def sampling_values(body: dict, limits) -> dict:
    stop = string_list(body, "stop")
    check_stop(stop, "stop", limits)
    max_tokens = field(body, "max_completion_tokens", "integer")
    if max_tokens is None:
        max_tokens = field(body, "max_tokens", "integer")
    return {
        "max_tokens": max_tokens,
        "temperature": field(body, "temperature", "number"),
        "top_p": field(body, "top_p", "number"),
        "top_k": field(body, "top_k", "integer"),
        "min_p": field(body, "min_p", "number"),
        "seed": field(body, "seed", "integer"),
        "presence_penalty": field(body, "presence_penalty", "number"),
        "frequency_penalty": field(body, "frequency_penalty", "number"),
        "repetition_penalty": field(body, "repetition_penalty", "number"),
        "ignore_eos": field(body, "ignore_eos", "boolean"),
        "stop": stop,
    }


def _message_content(m: dict, where: str) -> str:
    content = m.get("content")
    return "" if content is None else text_parts(content, where + ".content")


def parse_messages(body: dict, limits) -> list[dict]:
    messages = field(body, "messages", "array")
    if not messages:
        raise bad_request('"messages" is required and must not be empty', param="messages")
    return message_list(messages, ROLES, _message_content, limits, message_tool_fields)


def parse_prompt(body: dict, limits) -> str | list[int]:
    """A text or token-id prompt; at most limits.max_prompt_chars characters, or token ids (each is
    at least a character). Walks the ids: run it off the loop."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        check_prompt_chars([prompt], "prompt", limits)
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        check_count("prompt", len(prompt), "token ids", "max_prompt_chars", limits)
        if all(set(map(type, prompt[i:i + 16384])) <= {int} for i in range(0, len(prompt), 16384)):
            return prompt  # C loops of 16,384 ids, the event loop's turn between them; booleans are not ids
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request('"prompt": one prompt per request is supported, got a batch of '
                          f"{len(prompt)}", param="prompt")
    raise bad_request('"prompt" is required: a non-empty string or an array of token ids', param="prompt")


def _thinking(body: dict) -> think.Thinking:
    """``reasoning_effort``, or vLLM's ``chat_template_kwargs.enable_thinking``."""
    kwargs = field(body, "chat_template_kwargs", "object", {})
    enabled = field(kwargs, "enable_thinking", "boolean", prefix="chat_template_kwargs.")
    if enabled is not None:
        return think.Thinking(enabled, param="chat_template_kwargs.enable_thinking")
    return think.effort(field(body, "reasoning_effort", "string"), "reasoning_effort", strict=False)


# ---------------------------------------------------------------------------- shared flow

def _usage(answers_out: list) -> dict:
    prompt = answers_out[0].num_prompt_tokens
    completion = sum(out.num_generated_tokens for out in answers_out)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _tool_calls(calls: list[dict]) -> list[dict]:
    return [{"index": k, "id": new_call_id(), "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}} for k, c in enumerate(calls)]


async def _complete(request: web.Request, body: dict, make_prompt, chat: bool,
                    tools: ToolSpec | None = None, thinking: think.Thinking | None = None) -> web.StreamResponse:
    model = required_string(body, "model")
    n = _answers(body)
    values = sampling_values(body, limits_of(request))
    tools = tools or ToolSpec()
    structured = forced_output(tools) or await bounded(request, "checking the response_format schema",
                                                       openai_response_format, body, limits_of(request))
    top_logprobs = logprobs_requested(body) if chat else completion_requested(body)
    stream = field(body, "stream", "boolean", False)
    include_usage = stream and field(field(body, "stream_options", "object", {}), "include_usage", "boolean", False,
                                     prefix="stream_options.")
    ctx = context(request)
    timings = Timings()
    async with admit(request, model) as ticket, ctx.registry.use(model, None) as lease:
        check_serves(lease.model, model, "chat")
        preset = lease.entry.source.preset  # the model's options, system prompt, template (model_defaults.py)
        explicit = body.get("max_tokens") is not None or body.get("max_completion_tokens") is not None
        fill_openai_values(values, preset, explicit)
        thinking = think.checked(thinking or think.Thinking(False), lease.model, preset.template, model)
        prompt_ids = await bounded(request, "rendering the chat template and tokenising the prompt", make_prompt,
                                   lease.model, preset, budget_of(request), think.template_vars(thinking))
        plan = think.plan(thinking if chat else think.Thinking(False), lease.model, preset.template, prompt_ids,
                          structured)
        params = make_sampling_params(n=n, structured=plan.structured, logprobs=top_logprobs, **values,
                                      **plan.sampling)
        # A default never overflows the context (clip); an explicit max_tokens that does is a 400, as in vLLM.
        gen = checked_request(lease, prompt_ids, params, ticket.tenant, ticket.priority,
                              preset.options.get("num_ctx") or ctx.settings.server.context_length, clip=not explicit,
                              policies=ctx.node.tenant_policies, fair_group=ticket.fair_group)
        ticket.charge_tokens(len(prompt_ids) + n * gen.params.max_tokens, timings)
        lease.hold_tokens(len(prompt_ids) + n * gen.params.max_tokens)
        base = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                "object": "chat.completion.chunk" if stream and chat else "chat.completion" if chat
                else "text_completion",
                "created": int(time.time()), "model": model, "system_fingerprint": FINGERPRINT}
        shape = _Choices(chat, stream, plan.shape.thinks, include_usage, base,
                         TokenText(lease.model) if top_logprobs is not None else None, [0] * n)
        with EngineStream(lease.device, gen) as engine_stream:
            if stream:
                return await _relay_stream(request, engine_stream, timings, chat, n, include_usage, base, shape.chunk,
                                           shape.choice, [ReplyStream(tools, plan.shape) for _ in range(n)])
            answers = await collect(engine_stream, timings)
            choices = []
            for a in answers:
                reply = whole_reply(a.text, tools, plan.shape)
                choices.append(shape.choice(a.index, None if reply.calls else reply.text, a.out.finish_reason,
                                            a.logprobs, reply.calls, reply.thinking))
            return web.json_response({**base, "choices": choices, "usage": _usage([a.out for a in answers])})


@dataclass
class _Choices:
    """How one completion's answers are shaped: chat messages or deltas, or completions' text, with
    logprobs, reasoning and tool calls where asked."""
    chat: bool
    stream: bool
    thinks: bool
    include_usage: bool
    base: dict
    token_text: TokenText | None
    text_offsets: list[int]  # completions' logprobs.text_offset: characters streamed so far per answer

    def logprobs(self, index: int, items, text: str):
        if self.token_text is None:
            return None
        if self.chat:
            return {"content": self.token_text.entries(items), "refusal": None}
        entry = self.token_text.completion(items, self.text_offsets[index])
        self.text_offsets[index] += len(text)
        return entry

    def choice(self, index: int, text: str | None, finish_reason: str | None, items=None, calls=None,
               reasoning: str | None = None) -> dict:
        lp = self.logprobs(index, items, text or "") if items is not None else None
        if calls:
            finish_reason = finish_reason and "tool_calls"
        if self.chat and self.stream:
            delta = {} if text is None else {"content": text}
            return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
        if self.chat:
            message = {"role": "assistant", "content": None if calls else text}
            if self.thinks:
                message["reasoning_content"] = reasoning
            if calls:
                message["tool_calls"] = _tool_calls(calls)
            return {"index": index, "message": message, "logprobs": lp, "finish_reason": finish_reason}
        return {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish_reason}

    def chunk(self, c: dict) -> dict:
        return {**self.base, "choices": [c], **({"usage": None} if self.include_usage else {})}


async def _relay_stream(request, engine_stream, timings, chat: bool, n: int, include_usage: bool, base: dict, chunk,
                        choice, parts: list) -> web.StreamResponse:
    """A chat or completion stream: each answer's thinking as ``reasoning_content``, its text, and a tool
    call as vLLM streams one (its id and name, then its arguments as they are generated)."""
    calls_sent = [0] * n  # tool calls begun per answer
    finals: list = []

    def delta(index: int, d: dict, lp=None) -> dict:
        return chunk({"index": index, "delta": d, "logprobs": lp, "finish_reason": None})

    def events(index: int, items) -> list[dict]:
        chunks = []
        for kind, value in items:
            if kind == "text":
                chunks.append(chunk(choice(index, value, None)))
            elif kind == "thinking":
                chunks.append(delta(index, {"reasoning_content": value}))
            elif kind == "call":
                calls_sent[index] += 1
                chunks.append(delta(index, {"tool_calls": [{"index": calls_sent[index] - 1, "id": new_call_id(),
                                                            "type": "function",
                                                            "function": {"name": value, "arguments": ""}}]}))
            elif kind == "arguments":
                chunks.append(delta(index, {"tool_calls": [{"index": calls_sent[index] - 1,
                                                            "function": {"arguments": value}}]}))
            else:
                calls_sent[index] += len(value)
                chunks.append(delta(index, {"tool_calls": _tool_calls(value)}))
        return chunks

    def head() -> list[dict]:
        return [delta(i, {"role": "assistant", "content": ""}) for i in range(n)] if chat else []

    def piece(out) -> list[dict]:
        if not chat:
            return [chunk(choice(out.index, out.text, None, out.logprobs))] if out.text or out.logprobs else []
        chunks = events(out.index, parts[out.index].feed(out.text))
        if out.logprobs:  # the token's logprobs ride on its chunk (the first, if it made several)
            lp = choice(out.index, None, None, out.logprobs)["logprobs"]
            if chunks:
                chunks[0]["choices"][0]["logprobs"] = lp
            else:
                chunks.append(delta(out.index, {}, lp))
        return chunks + (events(out.index, parts[out.index].finish()) if out.finished else [])

    def tail(out) -> list[dict]:
        finals.append(out)
        reason = "tool_calls" if calls_sent[out.index] else out.finish_reason
        return [chunk(choice(out.index, None, reason))]

    def end() -> list[dict]:
        return [{**base, "choices": [], "usage": _usage(finals)}] if include_usage else []

    fmt = StreamFormat(sse=True, head=head, piece=piece, tail=tail, end=end,
                       error=lambda err: error_body(request.path, err))
    return await relay(request, engine_stream, timings, fmt)


# ---------------------------------------------------------------------------- handlers

async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await read_json_object(request)
    limits = limits_of(request)
    messages = await bounded(request, "reading the messages", parse_messages, body, limits)
    tools = await bounded(request, "checking the tools", parse_tools, body, limits, messages)
    return await _complete(request, body, lambda model, preset, budget, variables: encode_chat_with_tools(
        model, chat_with_presets(preset, messages), tools, budget, preset.template, **variables), chat=True,
        tools=tools, thinking=_thinking(body))


async def completions(request: web.Request) -> web.StreamResponse:
    body = await read_json_object(request)
    reject_unsupported(body, {"tools": "is not supported on /v1/completions; use /v1/chat/completions",
                              "response_format": "is not supported on /v1/completions; use /v1/chat/completions"})
    prompt = await bounded(request, "reading the prompt", parse_prompt, body, limits_of(request))

    def make_prompt(model, preset, budget, variables):  # a raw prompt: no system prompt, no template
        return encode_text(model, prompt) if isinstance(prompt, str) else prompt

    # OpenAI's legacy completions default to 16 tokens.
    return await _complete(request, body, make_prompt, chat=False)


async def _model_object(registry, source) -> dict:
    """A model entry; ``max_model_len`` (vLLM's field) is the model's context length."""
    desc = await registry.describe(source.name)
    return {"id": source.name, "object": "model", "created": int(source.modified_at()), "owned_by": "gpushare",
            "max_model_len": desc.context_length}


async def _listed_model(registry, source) -> dict:
    """A listing's entry: one model whose files cannot be read is listed without ``max_model_len`` (the
    log says why), so that it cannot fail the listing of every other model for everyone."""
    try:
        return await _model_object(registry, source)
    except ModelLoadError:
        return {"id": source.name, "object": "model", "created": int(source.modified_at()), "owned_by": "gpushare"}


async def list_models(request: web.Request) -> web.Response:
    registry = context(request).registry
    sources = registry.sources()
    data = [await _listed_model(registry, sources[name]) for name in sorted(visible(request, sources))]
    return web.json_response({"object": "list", "data": data})


async def get_model(request: web.Request) -> web.Response:
    check_model(request, request.match_info["model"])
    registry = context(request).registry
    return web.json_response(await _model_object(registry, registry.find(request.match_info["model"])))


async def create_embeddings(request: web.Request) -> web.Response:
    body = await read_json_object(request)
    model = required_string(body, "model")
    truncate = field(body, "truncate", "boolean", True)  # gpushare's, as Ollama's: false refuses a long input
    encoding = field(body, "encoding_format", "string", "float")
    if encoding not in ("float", "base64"):
        raise bad_request(f'"encoding_format" must be "float" or "base64", got {encoding!r}', param="encoding_format")
    raw = body.get("input")
    if isinstance(raw, str) or (isinstance(raw, list) and raw and all(isinstance(t, int) for t in raw)):
        inputs = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(x, (str, list)) for x in raw):
        inputs = raw
    else:
        raise bad_request('"input" must be a string, an array of strings, or token ids', param="input")
    vectors, timings = await embed_texts(request, model, inputs, None, truncate, body.get("dimensions"))

    encode = vector_base64 if encoding == "base64" else vector_json
    usage = {"prompt_tokens": timings.prompt_tokens, "total_tokens": timings.prompt_tokens}
    return await rows_response(request, {"object": "list", "model": model, "usage": usage}, "data", len(vectors),
                               lambda i: f'{{"object": "embedding", "index": {i}, "embedding": {encode(vectors[i])}}}')


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", get_model)
    app.router.add_post("/v1/embeddings", create_embeddings)
