"""OpenAI's HTTP API (/v1/*): chat completions, completions, models, embeddings.

Streams are server-sent events ending in ``data: [DONE]``; errors are OpenAI's
``{"error": {"message", "type", "param", "code"}}``. vLLM's extra sampling fields
(top_k, min_p, repetition_penalty, ignore_eos) are accepted. One choice per request:
`n` > 1, logprobs, tools and structured output are refused with a 400 that says so.
"""

from __future__ import annotations

import base64
import struct
import time
import uuid

from aiohttp import web

from gpushare.api.context import context, encode_text, off_loop
from gpushare.api.embeddings import embed_texts
from gpushare.api.errors import bad_request, error_body
from gpushare.api.fields import field, message_list, read_json_object, reject_unsupported, required_string, string_list
from gpushare.api.limits import check_prompt_chars, check_stop, limits_of
from gpushare.api.model_defaults import chat_with_presets, encode_with_template, fill_openai_values
from gpushare.api.streaming import (EngineStream, StreamFormat, Timings, collect, make_sampling_params, relay,
                                    usable_context)
from gpushare.api.tenants import admit, check_model, visible

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
FINGERPRINT = "gpushare"
UNSUPPORTED = ("logprobs", "top_logprobs", "tools", "functions", "logit_bias", "echo", "suffix")


# ---------------------------------------------------------------------------- request parsing

def _reject_unsupported(body: dict) -> None:
    n = field(body, "n", "integer", 1)
    if n != 1:
        raise bad_request(f'"n" must be 1: one choice per request is supported, got {n}', param="n")
    best_of = field(body, "best_of", "integer", 1)
    if best_of != 1:
        raise bad_request(f'"best_of" must be 1, got {best_of}', param="best_of")
    reject_unsupported(body, {key: "is not supported" for key in UNSUPPORTED})
    response_format = field(body, "response_format", "object", {"type": "text"})
    if response_format.get("type", "text") != "text":
        raise bad_request(f'"response_format" {response_format.get("type")!r} is not supported, only "text"',
                          param="response_format")


def sampling_values(body: dict, default_max_tokens: int | None, limits) -> dict:
    stop = string_list(body, "stop")
    check_stop(stop, "stop", limits)
    max_tokens = field(body, "max_completion_tokens", "integer")
    if max_tokens is None:
        max_tokens = field(body, "max_tokens", "integer", default_max_tokens)
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
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f'"{where}.content[{j}]": only {{"type": "text", "text": ...}} parts are supported',
                                  param=f"{where}.content")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f'"{where}.content" must be a string or an array of text parts', param=f"{where}.content")


def parse_messages(body: dict, limits) -> list[dict]:
    messages = field(body, "messages", "array")
    if not messages:
        raise bad_request('"messages" is required and must not be empty', param="messages")
    return message_list(messages, ROLES, _message_content, limits)


def parse_prompt(body: dict, limits) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        check_prompt_chars([prompt], "prompt", limits)
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request('"prompt": one prompt per request is supported, got a batch of '
                          f"{len(prompt)}", param="prompt")
    raise bad_request('"prompt" is required: a non-empty string or an array of token ids', param="prompt")


# ---------------------------------------------------------------------------- shared flow

def _usage(out) -> dict:
    return {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": out.num_generated_tokens,
            "total_tokens": out.num_prompt_tokens + out.num_generated_tokens}


async def _complete(request: web.Request, body: dict, make_prompt, default_max_tokens: int | None,
                    chat: bool) -> web.StreamResponse:
    model = required_string(body, "model")
    _reject_unsupported(body)
    values = sampling_values(body, default_max_tokens, limits_of(request))
    stream = field(body, "stream", "boolean", False)
    include_usage = stream and field(field(body, "stream_options", "object", {}), "include_usage", "boolean", False,
                                     prefix="stream_options.")
    ctx = context(request)
    timings = Timings()
    async with admit(request, model) as ticket, ctx.registry.use(model, None) as lease:
        preset = lease.entry.source.preset  # the model's options, system prompt, template (model_defaults.py)
        explicit = body.get("max_tokens") is not None or body.get("max_completion_tokens") is not None
        fill_openai_values(values, preset, explicit)
        prompt_ids = await off_loop(make_prompt, lease.model, preset)
        limit = usable_context(ctx.engine, lease.entry.name, lease.model.config.context_length, prompt_ids,
                               preset.options.get("num_ctx") or ctx.settings.server.context_length)
        # A default never overflows the context; an explicit max_tokens that does is a 400, as in vLLM.
        if not explicit:
            values["max_tokens"] = min(values["max_tokens"] or limit, limit - len(prompt_ids))
        params = make_sampling_params(**values)
        ticket.charge_tokens(len(prompt_ids) + params.max_tokens, timings)
        base = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                "object": "chat.completion.chunk" if stream and chat else "chat.completion" if chat
                else "text_completion",
                "created": int(time.time()), "model": model, "system_fingerprint": FINGERPRINT}

        def choice(text: str | None, finish_reason: str | None) -> dict:
            if chat and stream:
                delta = {} if text is None else {"content": text}
                return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            if chat:
                message = {"role": "assistant", "content": text}
                return {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}

        def chunk(c: dict) -> dict:
            return {**base, "choices": [c], **({"usage": None} if include_usage else {})}

        def head() -> list[dict]:
            if not chat:
                return []
            return [chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                           "finish_reason": None})]

        def tail(out) -> list[dict]:
            chunks = [chunk(choice(None, out.finish_reason))]
            if include_usage:
                chunks.append({**base, "choices": [], "usage": _usage(out)})
            return chunks

        with EngineStream(ctx.engine, lease.entry.name, prompt_ids, params, ticket.tenant) as engine_stream:
            if stream:
                fmt = StreamFormat(sse=True, head=head, piece=lambda text: chunk(choice(text, None)), tail=tail,
                                   error=lambda err: error_body(request.path, err))
                return await relay(request, engine_stream, timings, fmt)
            text, out = await collect(engine_stream, timings)
            return web.json_response({**base, "choices": [choice(text, out.finish_reason)], "usage": _usage(out)})


# ---------------------------------------------------------------------------- handlers

async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await read_json_object(request)
    messages = parse_messages(body, limits_of(request))
    return await _complete(request, body, lambda model, preset: encode_with_template(
        model, chat_with_presets(preset, messages), preset.template), None, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    body = await read_json_object(request)
    prompt = parse_prompt(body, limits_of(request))

    def make_prompt(model, preset):  # a raw prompt: the model's system prompt and template do not apply
        return encode_text(model, prompt) if isinstance(prompt, str) else prompt

    # OpenAI's legacy completions default to 16 tokens.
    return await _complete(request, body, make_prompt, 16, chat=False)


def _model_object(source) -> dict:
    return {"id": source.name, "object": "model", "created": int(source.modified_at()), "owned_by": "gpushare"}


async def list_models(request: web.Request) -> web.Response:
    sources = context(request).registry.sources()
    data = [_model_object(sources[name]) for name in sorted(visible(request, sources))]
    return web.json_response({"object": "list", "data": data})


async def get_model(request: web.Request) -> web.Response:
    check_model(request, request.match_info["model"])
    return web.json_response(_model_object(context(request).registry.find(request.match_info["model"])))


async def create_embeddings(request: web.Request) -> web.Response:
    body = await read_json_object(request)
    model = required_string(body, "model")
    if body.get("dimensions"):
        raise bad_request('"dimensions" is not supported', param="dimensions")
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
    vectors, timings = await embed_texts(request, model, inputs, None)

    def encode(v: list[float]):
        return base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode() if encoding == "base64" else v

    data = [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(vectors)]
    usage = {"prompt_tokens": timings.prompt_tokens, "total_tokens": timings.prompt_tokens}
    return web.json_response({"object": "list", "data": data, "model": model, "usage": usage})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", get_model)
    app.router.add_post("/v1/embeddings", create_embeddings)
