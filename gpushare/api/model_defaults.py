"""A model's presets applied to one request, and a long chat fitted to the context as Ollama does.

The model's options (ModelPreset.options) sit under the request's `options`; its system
prompt goes first unless the chat starts with its own; its MESSAGEs go before the chat's;
its TEMPLATE (Jinja) replaces the file's chat template. A chat longer than the context a
request may use (num_ctx, the model's KV pool) loses its oldest messages, system messages
kept and the last message always, until it fits (Ollama's chatPrompt); `"truncate": false`
keeps the 400.
"""

from __future__ import annotations

import functools

from gpushare.api.context import encode_chat
from gpushare.api.errors import bad_request
from gpushare.api.fields import field
from gpushare.settings.model_options import ModelPreset
from gpushare.catalog import chat_template


def with_model_options(body: dict, preset: ModelPreset) -> dict:
    """The body with the model's options under the request's own (a request's value wins)."""
    if not preset.options:
        return body
    return {**body, "options": {**preset.options, **field(body, "options", "object", {})}}


def chat_with_presets(preset: ModelPreset, messages: list[dict]) -> list[dict]:
    """The model's MESSAGEs, then the chat; the model's system prompt first unless the chat brings one."""
    out = [*preset.messages, *messages]
    if preset.system and not (messages and messages[0]["role"] == "system"):
        out.insert(0, {"role": "system", "content": preset.system})
    return out


@functools.lru_cache(maxsize=32)
def _compiled(source: str):
    return chat_template.compile_template(source)


def encode_with_template(model, messages: list[dict], template: str | None, **extra) -> list[int]:
    """Token ids of a chat through `template` (a preset's TEMPLATE), else the model file's own; ``extra``:
    more template variables (``tools``)."""
    if template is None:
        return encode_chat(model, messages, **extra)
    try:
        text = chat_template.render(_compiled(template), messages, model.tokenizer.bos_token,
                                    model.tokenizer.eos_token, add_generation_prompt=True, **extra)
    except ValueError as e:  # TemplateError
        raise bad_request(f"the model's TEMPLATE failed on these messages: {e}", param="messages") from None
    return model.tokenizer.encode(text, add_special_tokens=False)


def context_room(engine, model_name: str, context_length: int, num_ctx: int | None) -> int:
    """The most tokens one request on this model may hold: its context, num_ctx, its KV pool."""
    room = min(context_length, num_ctx or context_length)
    stats = engine.stats().models.get(model_name)
    return min(room, stats.blocks_total * stats.block_size) if stats else room


def fit_chat(encode, messages: list[dict], room: int, truncate: bool = True) -> list[int]:
    """Token ids of the longest tail of `messages` whose prompt leaves room for a token, keeping
    the system messages of the part dropped and always the last message (Ollama's truncation).

    Dropping more never lengthens the prompt, so the first start that fits is found by bisection:
    a few encodings, not one per message of a long chat."""
    ids = encode(messages)
    if len(ids) < room or not truncate:
        return ids

    def tail(start: int) -> list[dict]:
        return [m for m in messages[:start] if m["role"] == "system"] + messages[start:]

    low, high = 1, len(messages) - 1  # the answer is in [low, high]; high (the last message alone) always goes
    best = None
    while low <= high:
        mid = (low + high) // 2
        mid_ids = encode(tail(mid))
        if len(mid_ids) < room:
            best, high = mid_ids, mid - 1
        else:
            low = mid + 1
    return best if best is not None else encode(tail(len(messages) - 1))  # too long still: usable_context's 400


# Ollama option -> the OpenAI dialect's sampling field it fills when a request leaves that field unset.
OPENAI_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
                 "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                 "repeat_penalty": "repetition_penalty", "stop": "stop", "num_predict": "max_tokens"}


def fill_openai_values(values: dict, preset: ModelPreset, explicit_max_tokens: bool) -> None:
    """The model's options where an OpenAI request set nothing (its own max_tokens always wins)."""
    for option, key in OPENAI_FIELDS.items():
        value = preset.options.get(option)
        if value is None or (key == "max_tokens" and explicit_max_tokens) or values.get(key) not in (None, []):
            continue
        if option == "num_predict" and value <= 0:
            continue  # Ollama's "no limit": the context decides
        values[key] = -1 if option == "top_k" and value == 0 else value
