"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens.

A request becomes one chat turn (api/turn.py), the path chat completions take: ``system`` and the
``messages``' text, ``tool_use`` and ``tool_result`` blocks go through the model's chat template
with the ``tools`` (their ``input_schema`` as the function's parameters); ``tool_choice`` ``any``
or ``tool`` holds the output to a call by the grammar, as OpenAI's ``required`` and named choices
do. ``thinking`` (enabled, with ``budget_tokens``) gives ``thinking`` blocks on thinking models,
the budget held by the grammar (api/thinking.py). A stream is Anthropic's event sequence
(``message_start`` ... ``message_stop``, ``ping`` on long waits). Errors are Anthropic's error
objects (api/errors.py); a tenant's key may come as ``x-api-key``; ``anthropic-version`` is accepted
whatever it says.
"""

from __future__ import annotations

import json
import uuid

from aiohttp import web

from gpushare.api import signatures, thinking as think
from gpushare.api.errors import bad_request, error_body
from gpushare.api.fields import field, read_json_object, reject_unsupported, required_string, string_list, text_parts
from gpushare.api.limits import check_count, check_prompt_chars, check_stop, limits_of
from gpushare.api.streaming import StreamFormat, collect, relay
from gpushare.api.tools import parse_tools
from gpushare.api.turn import ReplyStream, Turn, count_prompt, running, whole_reply
from gpushare.api.work import bounded

UNSUPPORTED = {"mcp_servers": "is not supported", "container": "is not supported"}
FIELD_NAMES = {"max_tokens": "max_tokens", "stop": "stop_sequences"}
STOP_REASONS = {"length": "max_tokens"}
COUNTING_MAX_TOKENS = 1 << 30  # count_tokens takes no max_tokens; a thinking budget is checked against this


# ---------------------------------------------------------------------------- request parsing

def _blocks(m: dict, where: str) -> list[dict]:
    content = m.get("content")
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_request(f'"{where}.content" must be a string or an array of content blocks', param=where + ".content")
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise bad_request(f'"{where}.content[{j}]" must be a content block with a "type"',
                              param=f"{where}.content[{j}]")
    return content


def _thought(block: dict, at: str) -> str:
    """A thinking block sent back: its text, when its signature is this daemon's."""
    thinking, signature = block.get("thinking"), block.get("signature")
    if not isinstance(thinking, str):
        raise bad_request(f'"{at}.thinking" must be a string', param=at + ".thinking")
    if not isinstance(signature, str) or not signatures.verifies(thinking, signature):
        raise bad_request(f'"{at}.signature" is not a valid signature of this thinking block (a thinking block '
                          'must be sent back as this server wrote it)', param=at + ".signature")
    return thinking


def _assistant(blocks: list[dict], where: str, calls: dict) -> list[dict]:
    text, tool_calls, thoughts = [], [], []
    for j, block in enumerate(blocks):
        at, kind = f"{where}.content[{j}]", block["type"]
        if kind == "text":
            text.append(text_parts([block], at))
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise bad_request(f'"{at}" (tool_use) needs a string "id" and "name"', param=at)
            if not isinstance(block.get("input", {}), dict):
                raise bad_request(f'"{at}.input" must be an object', param=at + ".input")
            calls[block["id"]] = block["name"]
            tool_calls.append({"type": "function", "id": block["id"],
                               "function": {"name": block["name"], "arguments": block.get("input", {})}})
        elif kind == "thinking":
            thoughts.append(_thought(block, at))
        elif kind != "redacted_thinking":  # redacted thinking is Anthropic's own ciphertext: dropped
            raise bad_request(f'"{at}.type" {kind!r} is not supported in an assistant message (text, tool_use, '
                              'thinking)', param=at + ".type")
    # The thinking goes to the template under both names templates read (gpt-oss's, Qwen3's); others drop it.
    shown = {"thinking": "".join(thoughts), "reasoning_content": "".join(thoughts)} if thoughts else {}
    return [{"role": "assistant", "content": "".join(text), **shown,
             **({"tool_calls": tool_calls} if tool_calls else {})}]


def _user(blocks: list[dict], where: str, calls: dict) -> list[dict]:
    out, text = [], []
    for j, block in enumerate(blocks):
        at, kind = f"{where}.content[{j}]", block["type"]
        if kind == "text":
            text.append(text_parts([block], at))
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if call_id not in calls:
                raise bad_request(f'"{at}.tool_use_id" {call_id!r} names no tool_use block of an earlier '
                                  'assistant message', param=at + ".tool_use_id")
            result = text_parts(block.get("content", ""), at + ".content")
            if block.get("is_error"):
                result = "Error: " + result
            out.append({"role": "tool", "content": result, "tool_call_id": call_id, "name": calls[call_id]})
        else:
            raise bad_request(f'"{at}.type" {kind!r} is not supported in a user message (text, tool_result)',
                              param=at + ".type")
    return out + ([{"role": "user", "content": "".join(text)}] if text else [])


def parse_messages(body: dict, limits) -> list[dict]:
    """``system`` and ``messages`` as chat-template messages (tool calls and results as api/tools has them)."""
    raw = field(body, "messages", "array")
    if not raw:
        raise bad_request('"messages" is required and must not be empty', param="messages")
    check_count("messages", len(raw), "messages", "max_messages", limits)
    system = body.get("system")
    out = [{"role": "system", "content": text_parts(system, "system")}] if system else []
    calls: dict[str, str] = {}  # tool_use id -> its tool's name
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise bad_request(f'"{where}.role" must be "user" or "assistant", got {role!r}', param=where + ".role")
        blocks = _blocks(m, where)
        out += _assistant(blocks, where, calls) if role == "assistant" else _user(blocks, where, calls)
    # Checked again as rendered, before any template: each tool_result block is a message of its own.
    check_count("messages", len(out) - bool(system), "messages once each tool_result block is one",
                "max_messages", limits)
    check_prompt_chars((m["content"] for m in out), "messages", limits)
    return out


def _tools(body: dict, limits, messages: list[dict]):
    raw = field(body, "tools", "array", [])
    tools = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            raise bad_request(f'"{where}": only client tools ({{"name", "description", "input_schema"}}) are '
                              f'supported, got type {tool.get("type") if isinstance(tool, dict) else tool!r}',
                              param=where)
        if not isinstance(tool.get("input_schema"), dict):
            raise bad_request(f'"{where}.input_schema" is required: a JSON Schema object',
                              param=where + ".input_schema")
        tools.append({"type": "function", "function": {"name": tool.get("name"), "description": tool.get("description"),
                                                       "parameters": tool["input_schema"]}})
    choice = field(body, "tool_choice", "object", {"type": "auto"})
    kind = choice.get("type")
    openai_choice = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        openai_choice = {"type": "function", "function": {"name": choice.get("name")}}
    elif openai_choice is None:
        raise bad_request(f'"tool_choice.type" must be "auto", "any", "tool" or "none", got {kind!r}',
                          param="tool_choice.type")
    return parse_tools({"tools": tools, "tool_choice": openai_choice}, limits, messages)


def _thinking(body: dict, max_tokens: int) -> think.Thinking:
    value = field(body, "thinking", "object")
    if value is None:
        return think.Thinking(param="thinking")
    kind = value.get("type")
    if kind == "disabled":
        return think.Thinking(False, param="thinking")
    if kind != "enabled":
        raise bad_request(f'"thinking.type" must be "enabled" or "disabled", got {kind!r}', param="thinking.type")
    budget = field(value, "budget_tokens", "integer", prefix="thinking.")
    if budget is None or budget < 1:
        raise bad_request('"thinking.budget_tokens" is required: a positive integer', param="thinking.budget_tokens")
    if budget >= max_tokens:
        raise bad_request(f'"thinking.budget_tokens" ({budget}) must be less than "max_tokens" ({max_tokens})',
                          param="thinking.budget_tokens")
    return think.Thinking(True, budget, param="thinking")


def parse_turn(body: dict, limits, counting: bool = False) -> Turn:
    """The turn a body asks for; ``counting`` (count_tokens): ``max_tokens`` is not needed."""
    model = required_string(body, "model")
    reject_unsupported(body, UNSUPPORTED)
    max_tokens = field(body, "max_tokens", "integer", COUNTING_MAX_TOKENS if counting else None)
    if max_tokens is None:
        raise bad_request('"max_tokens" is required', param="max_tokens")
    if max_tokens < 1:
        raise bad_request(f'"max_tokens" must be at least 1, got {max_tokens}', param="max_tokens")
    field(body, "metadata", "object")  # user_id: nothing here to do with it
    stop = string_list(body, "stop_sequences")
    check_stop(stop, "stop_sequences", limits)
    values = {"max_tokens": max_tokens, "temperature": field(body, "temperature", "number"),
              "top_p": field(body, "top_p", "number"), "top_k": field(body, "top_k", "integer"), "stop": stop,
              "ignore_eos": field(body, "ignore_eos", "boolean")}  # vLLM's, as /v1/chat/completions takes it
    messages = parse_messages(body, limits)
    return Turn(model, messages, values, _tools(body, limits, messages), thinking=_thinking(body, max_tokens),
                field_names=FIELD_NAMES)


# ---------------------------------------------------------------------------- the reply

def _stop(out, called: bool) -> tuple[str, str | None]:
    if called:
        return "tool_use", None
    if out.stop_reason is not None:
        return "stop_sequence", out.stop_reason
    return STOP_REASONS.get(out.finish_reason, "end_turn"), None


def _tool_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _message(body_id: str, model: str, content: list, stop: tuple, usage: dict) -> dict:
    return {"id": body_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}


async def messages(request: web.Request) -> web.StreamResponse:
    body = await read_json_object(request)
    turn = await bounded(request, "reading the messages and tools", parse_turn, body, limits_of(request))
    stream = field(body, "stream", "boolean", False)
    message_id = f"msg_{uuid.uuid4().hex[:24]}"
    async with running(request, turn) as run:
        if stream:
            return await relay(request, run.stream, run.timings, _stream_format(request, run, message_id, turn.model))
        answer = (await collect(run.stream, run.timings))[0]
        reply = whole_reply(answer.text, run.tools, run.shape)
        content = ([{"type": "thinking", "thinking": reply.thinking, "signature": signatures.sign(reply.thinking)}]
                   if run.shape.thinks else [])
        content += [{"type": "text", "text": reply.text}] if reply.text or not reply.calls else []
        content += [{"type": "tool_use", "id": _tool_id(), "name": c["name"], "input": c["arguments"]}
                    for c in reply.calls or []]
        usage = {"input_tokens": answer.out.num_prompt_tokens, "output_tokens": answer.out.num_generated_tokens}
        return web.json_response(_message(message_id, turn.model, content, _stop(answer.out, bool(reply.calls)), usage))


class ContentBlocks:
    """The content blocks of a streamed message, with Anthropic's events that build them: a block per part
    (thinking, text, each tool call), opened when its first piece comes and closed when the next part
    begins or the reply ends."""

    def __init__(self):
        self.index = -1
        self.kind: str | None = None  # the open block's type
        self.thought = ""  # the open thinking block's text, signed when it closes

    def open(self, kind: str, start: dict) -> list[dict]:
        events = self.close()
        self.index, self.kind = self.index + 1, kind
        return events + [{"type": "content_block_start", "index": self.index, "content_block": start}]

    def close(self) -> list[dict]:
        if self.kind is None:
            return []
        events = ([self.delta({"type": "signature_delta", "signature": signatures.sign(self.thought)})]
                  if self.kind == "thinking" else [])
        self.kind, self.thought = None, ""
        return events + [{"type": "content_block_stop", "index": self.index}]

    def delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def text(self, kind: str, start: dict, delta: dict) -> list[dict]:
        return (self.open(kind, start) if self.kind != kind else []) + [self.delta(delta)]

    def of(self, parts) -> list[dict]:
        """The events of a reply's parts (api/turn.ReplyStream)."""
        events = []
        for kind, value in parts:
            if kind == "thinking":
                events += self.text("thinking", {"type": "thinking", "thinking": "", "signature": ""},
                                    {"type": "thinking_delta", "thinking": value})
                self.thought += value
            elif kind == "text":
                events += self.text("text", {"type": "text", "text": ""}, {"type": "text_delta", "text": value})
            elif kind == "call":
                events += self.open("tool_use", _tool_use(value))
            elif kind == "arguments":
                events.append(self.delta({"type": "input_json_delta", "partial_json": value}))
            else:  # calls sent whole
                for call in value:
                    events += self.open("tool_use", _tool_use(call["name"]))
                    whole = json.dumps(call["arguments"])
                    events.append(self.delta({"type": "input_json_delta", "partial_json": whole}))
        return events


def _tool_use(name: str) -> dict:
    return {"type": "tool_use", "id": _tool_id(), "name": name, "input": {}}


def _stream_format(request: web.Request, run, message_id: str, model: str) -> StreamFormat:
    parts = ReplyStream(run.tools, run.shape)
    blocks = ContentBlocks()

    def head() -> list[dict]:
        usage = {"input_tokens": len(run.prompt_ids), "output_tokens": 0}
        return [{"type": "message_start", "message": _message(message_id, model, [], (None, None), usage)},
                {"type": "ping"}]

    def piece(out) -> list[dict]:
        return blocks.of(parts.feed(out.text)) + (blocks.of(parts.finish()) if out.finished else [])

    def tail(out) -> list[dict]:
        # Nothing said: an empty text block, as Anthropic sends.
        events = blocks.open("text", {"type": "text", "text": ""}) if blocks.index < 0 else []
        stop_reason, stop_sequence = _stop(out, parts.called)
        return events + blocks.close() + [
            {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
             "usage": {"output_tokens": out.num_generated_tokens}},
            {"type": "message_stop"}]

    return StreamFormat(sse=True, typed_events=True, head=head, piece=piece, tail=tail,
                        error=lambda err: error_body(request.path, err), ping=lambda: {"type": "ping"})


async def count_tokens(request: web.Request) -> web.Response:
    body = await read_json_object(request)
    turn = await bounded(request, "reading the messages and tools", parse_turn, body, limits_of(request), True)
    return web.json_response({"input_tokens": await count_prompt(request, turn)})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
