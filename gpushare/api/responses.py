"""OpenAI's Responses API: POST /v1/responses.

A request becomes one chat turn (api/turn.py), the path chat completions take: ``instructions``
and ``input`` (a string, or message, ``function_call`` and ``function_call_output`` items) through
the chat template with the function ``tools``; ``tool_choice`` ``required`` or a named function and
``text.format`` (JSON Schema) hold the output to their grammar; ``reasoning.effort`` sets a thinking
model's budget (api/thinking.py). Output items are ``reasoning``, ``message`` and ``function_call``;
a stream is the Responses event sequence (``response.created`` ... ``response.completed``).
Responses are not stored: ``store: true`` and ``previous_response_id`` are a 400 (send the whole
conversation as ``input``, as with ``store: false``).
"""

from __future__ import annotations

import json
import time
import uuid

from aiohttp import web

from gpushare.api import thinking as think
from gpushare.api.errors import bad_request, error_body
from gpushare.api.fields import field, read_json_object, reject_unsupported, required_string, text_parts
from gpushare.api.limits import check_count, check_prompt_chars, limits_of
from gpushare.api.streaming import StreamFormat, collect, relay
from gpushare.api.structured import openai_response_format
from gpushare.api.tools import new_call_id, parse_tools
from gpushare.api.turn import ReplyStream, Turn, running, whole_reply
from gpushare.api.work import bounded

UNSUPPORTED = {"previous_response_id": "is not supported: responses are not stored; send the whole conversation "
                                       "as \"input\"",
               "background": "is not supported", "conversation": "is not supported: responses are not stored",
               "prompt": "(a stored prompt template) is not supported"}
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
FIELD_NAMES = {"max_tokens": "max_output_tokens"}


# ---------------------------------------------------------------------------- request parsing

def _content(value, where: str) -> str:
    return text_parts(value, where, ("input_text", "output_text", "text"))


def _item(item, where: str, calls: dict, out: list[dict]) -> None:
    if not isinstance(item, dict):
        raise bad_request(f'"{where}" must be an object', param=where)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ROLES:
            raise bad_request(f'"{where}.role" must be one of {", ".join(ROLES)}, got {role!r}', param=where + ".role")
        out.append({"role": ROLES[role], "content": _content(item.get("content", ""), where + ".content")})
    elif kind == "function_call":
        if not isinstance(item.get("call_id"), str) or not isinstance(item.get("name"), str):
            raise bad_request(f'"{where}" (function_call) needs a string "call_id" and "name"', param=where)
        try:
            arguments = json.loads(item.get("arguments") or "{}")
        except (TypeError, json.JSONDecodeError):
            arguments = None
        if not isinstance(arguments, dict):
            raise bad_request(f'"{where}.arguments" must be a JSON object as text', param=where + ".arguments")
        calls[item["call_id"]] = item["name"]
        call = {"type": "function", "id": item["call_id"], "function": {"name": item["name"], "arguments": arguments}}
        if out and out[-1]["role"] == "assistant" and not out[-1]["content"]:
            out[-1].setdefault("tool_calls", []).append(call)  # one assistant turn's several calls
        else:
            out.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        if item.get("call_id") not in calls:
            raise bad_request(f'"{where}.call_id" {item.get("call_id")!r} names no earlier function_call item',
                              param=where + ".call_id")
        output = item.get("output")
        text = output if isinstance(output, str) else _content(output, where + ".output")
        out.append({"role": "tool", "content": text, "tool_call_id": item["call_id"], "name": calls[item["call_id"]]})
    elif kind != "reasoning":  # past reasoning is not shown to the model again
        raise bad_request(f'"{where}.type" {kind!r} is not supported (message, function_call, '
                          'function_call_output, reasoning)', param=where + ".type")


def parse_input(body: dict, limits) -> list[dict]:
    raw = body.get("input")
    instructions = field(body, "instructions", "string")
    out = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(raw, str) and raw:
        out.append({"role": "user", "content": raw})
    elif isinstance(raw, list) and raw:
        check_count("input", len(raw), "items", "max_messages", limits)
        calls: dict[str, str] = {}
        for i, item in enumerate(raw):
            _item(item, f"input[{i}]", calls, out)
    else:
        raise bad_request('"input" is required: a string or an array of items', param="input")
    check_prompt_chars((m["content"] for m in out), "input", limits)
    return out


def _tools(body: dict, limits, messages: list[dict]):
    raw = field(body, "tools", "array", [])
    tools = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(f'"tools[{i}]": only function tools are supported', param=f"tools[{i}]")
        tools.append({"type": "function", "function": {k: tool.get(k) for k in ("name", "description", "parameters")}})
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return parse_tools({"tools": tools, "tool_choice": choice}, limits, messages)


def _format(body: dict, limits):
    """``text.format``, the shape of chat's response_format with the json_schema fields inline."""
    fmt = field(field(body, "text", "object", {}), "format", "object", prefix="text.")
    if fmt is None or fmt.get("type") != "json_schema":
        return openai_response_format({"response_format": fmt}, limits)
    spec = {"name": fmt.get("name"), "schema": fmt.get("schema", {"type": "object"}),
            "strict": fmt.get("strict", False)}
    return openai_response_format({"response_format": {"type": "json_schema", "json_schema": spec}}, limits)


def parse_turn(body: dict, limits) -> Turn:
    model = required_string(body, "model")
    reject_unsupported(body, UNSUPPORTED)
    if field(body, "store", "boolean", False):
        raise bad_request('"store" true is not supported: responses are not stored here; send "store": false',
                          param="store")
    reasoning = field(body, "reasoning", "object", {})
    thinking = think.effort(field(reasoning, "effort", "string", prefix="reasoning."), "reasoning.effort", strict=False)
    values = {"max_tokens": field(body, "max_output_tokens", "integer"),
              "temperature": field(body, "temperature", "number"), "top_p": field(body, "top_p", "number")}
    messages = parse_input(body, limits)
    return Turn(model, messages, values, _tools(body, limits, messages), _format(body, limits), thinking,
                FIELD_NAMES)


# ---------------------------------------------------------------------------- the reply

def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _reasoning(text: str) -> dict:
    return {"type": "reasoning", "id": _id("rs"), "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": "completed"}


def _message(text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": _id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call(name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": _id("fc"), "call_id": new_call_id(), "name": name, "arguments": arguments,
            "status": status}


def _response(base: dict, status: str, output: list, out=None) -> dict:
    usage = None
    if out is not None:
        usage = {"input_tokens": out.num_prompt_tokens, "output_tokens": out.num_generated_tokens,
                 "total_tokens": out.num_prompt_tokens + out.num_generated_tokens,
                 "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
                 "output_tokens_details": {"reasoning_tokens": 0}}
    incomplete = {"reason": "max_output_tokens"} if out is not None and out.finish_reason == "length" else None
    return {**base, "status": "incomplete" if incomplete else status, "output": output, "usage": usage,
            "incomplete_details": incomplete}


async def create_response(request: web.Request) -> web.StreamResponse:
    body = await read_json_object(request)
    turn = await bounded(request, "reading the input and tools", parse_turn, body, limits_of(request))
    base = {"id": _id("resp"), "object": "response", "created_at": int(time.time()), "model": turn.model,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"), "store": False,
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools", []),
            "parallel_tool_calls": False, "text": body.get("text", {"format": {"type": "text"}}),
            "metadata": body.get("metadata") or {}, "error": None}
    async with running(request, turn) as run:
        if field(body, "stream", "boolean", False):
            return await relay(request, run.stream, run.timings, _stream_format(request, run, base))
        answer = (await collect(run.stream, run.timings))[0]
        reply = whole_reply(answer.text, run.tools, run.shape)
        output = [_reasoning(reply.thinking)] if run.shape.thinks else []
        output += [_call(c["name"], json.dumps(c["arguments"])) for c in reply.calls or []]
        output += [_message(reply.text)] if not reply.calls else []
        return web.json_response(_response(base, "completed", output, answer.out))


class OutputItems:
    """The output items of a streamed response, with the events that build them: an item per part
    (reasoning, message, each call), added when its first piece comes and done when the next part
    begins or the reply ends."""

    def __init__(self):
        self.output: list[dict] = []
        self.open: dict | None = None
        self.sequence = 0

    def event(self, kind: str, **fields) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence, **fields}

    def _at(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.output) - 1}

    def close(self) -> list[dict]:
        item = self.open
        if item is None:
            return []
        at = self._at()
        self.open, item["status"] = None, "completed"
        if item["type"] == "function_call":
            events = [self.event("response.function_call_arguments.done", **at, arguments=item["arguments"])]
        else:
            part = item["content"][0]
            events = [self.event(f"response.{_text_kind(item)}.done", **at, content_index=0, text=part["text"]),
                      self.event("response.content_part.done", **at, content_index=0, part=part)]
        return events + [self.event("response.output_item.done", output_index=at["output_index"], item=item)]

    def add(self, item: dict) -> list[dict]:
        events = self.close()
        self.open = {**item, "status": "in_progress"}
        self.output.append(self.open)
        events.append(self.event("response.output_item.added", output_index=len(self.output) - 1, item=self.open))
        if item["type"] != "function_call":
            events.append(self.event("response.content_part.added", **self._at(), content_index=0,
                                     part=self.open["content"][0]))
        return events

    def text(self, kind: str, make, value: str) -> list[dict]:
        events = self.add(make("")) if self.open is None or self.open["type"] != kind else []
        self.open["content"][0]["text"] += value
        return events + [self.event(f"response.{_text_kind(self.open)}.delta", **self._at(), content_index=0,
                                    delta=value)]

    def arguments(self, value: str) -> list[dict]:
        self.open["arguments"] += value
        return [self.event("response.function_call_arguments.delta", **self._at(), delta=value)]

    def of(self, parts) -> list[dict]:
        """The events of a reply's parts (api/turn.ReplyStream)."""
        events = []
        for kind, value in parts:
            if kind == "thinking":
                events += self.text("reasoning", _reasoning, value)
            elif kind == "text":
                events += self.text("message", _message, value)
            elif kind == "call":
                events += self.add(_call(value, ""))
            elif kind == "arguments":
                events += self.arguments(value)
            else:
                for call in value:
                    events += self.add(_call(call["name"], "")) + self.arguments(json.dumps(call["arguments"]))
        return events


def _text_kind(item: dict) -> str:
    return "output_text" if item["type"] == "message" else "reasoning_text"


def _stream_format(request: web.Request, run, base: dict) -> StreamFormat:
    parts = ReplyStream(run.tools, run.shape)
    items = OutputItems()

    def head() -> list[dict]:
        started = _response(base, "in_progress", [])
        return [items.event("response.created", response=started), items.event("response.in_progress",
                                                                                 response=started)]

    def piece(out) -> list[dict]:
        return items.of(parts.feed(out.text)) + (items.of(parts.finish()) if out.finished else [])

    def tail(out) -> list[dict]:
        events = (items.add(_message("")) if not items.output else []) + items.close()
        final = _response(base, "completed", items.output, out)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return events + [items.event(kind, response=final)]

    def error(err) -> dict:
        body = error_body(request.path, err)["error"]
        return items.event("error", code=body["code"] or body["type"], message=body["message"], param=body["param"])

    return StreamFormat(sse=True, typed_events=True, head=head, piece=piece, tail=tail, error=error)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/responses", create_response)
