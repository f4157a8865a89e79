"""Tool calling for both dialects: tools and tool_choice parsed, the prompt rendered, calls parsed back.

The tools go through the model's own chat template when it handles them (it renders differently
with a ``tools`` variable). Otherwise (SmolLM2's template, ChatML) a system-prompt section lists
each function with its JSON Schema and asks for a call as one JSON object
``{"name": ..., "arguments": {...}}``; assistant tool calls in the history are written back in
that form. ``tool_choice`` ``required`` or a named function constrain the output to exactly one
such object whose arguments validate against the function's ``parameters`` (constrained
decoding); ``auto`` lets the model choose, and a reply that is a call in either form (that object,
or Hermes/Qwen ``<tool_call>`` tags) becomes a tool call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from gpushare.api import template_runner
from gpushare.api.model_defaults import encode_with_template
from gpushare.api.errors import bad_request
from gpushare.api.limits import check_count, check_prompt_chars
from gpushare.api.work import WorkBudget
from gpushare.catalog.chat_template import TemplateError
from gpushare.protocol.structured_output import SchemaError, StructuredOutput, check_schema

TOOL_CALL_TAG = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
CALL_STARTS = ("{", "[", "<tool_call>")  # how a reply that is a tool call begins
FALLBACK_INSTRUCTIONS = (
    "You can call the following tools. Each is a function with a JSON Schema of its arguments:\n{tools}\n"
    "To call a tool, reply with only a JSON object of this form and nothing else: "
    '{{"name": "<tool name>", "arguments": {{<arguments>}}}}'
)


@dataclass
class ToolSpec:
    """The request's tools (OpenAI's shape, as Hugging Face chat templates take them) and choice."""
    tools: list[dict] = field(default_factory=list)
    choice: str = "auto"  # none | auto | required | named
    forced_name: str | None = None  # with choice "named"

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.active and self.choice in ("required", "named")

    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}


def parse_tools(body: dict, limits, messages: list[dict] = ()) -> ToolSpec:
    """``tools`` and ``tool_choice`` of either dialect; 400 naming the field that is wrong, or the limit
    passed: at most ``limits.max_tools`` tools, their parameters at most ``limits.max_schema_chars``
    of JSON together, and the chat's texts (``prompt_texts``: everything but the parameters a template may
    write) at most ``limits.max_prompt_chars``. Compiles every schema: run it off the loop."""
    raw = body.get("tools")
    if raw is None:
        raw = []
    if not isinstance(raw, list):
        raise bad_request('"tools" must be an array of tools', param="tools")
    check_count("tools", len(raw), "tools", "max_tools", limits)
    tools, schema_chars = [], 0
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise bad_request(f'"{where}" must be {{"type": "function", "function": {{...}}}}', param=where)
        function = tool.get("function")
        if not isinstance(function, dict):
            raise bad_request(f'"{where}.function" must be an object', param=where + ".function")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f'"{where}.function.name" is required: a non-empty string',
                              param=where + ".function.name")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        schema_chars += len(json.dumps(parameters))
        if schema_chars > limits.max_schema_chars:
            raise bad_request(f'"tools" have parameters of more than {limits.max_schema_chars} characters of JSON '
                              f'together, the limit (limits.max_schema_chars), by {where}', param="tools")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise bad_request(f'"{where}.function.description" must be a string', param=where + ".function.description")
        tools.append({"type": "function", "function": {"name": name, "description": description or "",
                                                       "parameters": parameters}})
    check_prompt_chars(prompt_texts(messages, tools), "messages", limits)
    for i, tool in enumerate(tools):  # compiled once all is known to be within bounds
        function = tool["function"]
        try:
            check_schema(call_schema(function["name"], function["parameters"]))
        except SchemaError as e:
            where = f"tools[{i}].function.parameters"
            raise bad_request(f'"{where}" {e}', param=where) from None
    spec = ToolSpec(tools)
    choice = body.get("tool_choice")
    if choice is None:
        spec.choice = "auto"
    elif choice in ("none", "auto", "required"):
        spec.choice = choice
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        spec.choice, spec.forced_name = "named", choice["function"].get("name")
        if spec.forced_name not in spec.names():
            raise bad_request(f'"tool_choice.function.name" must name one of "tools", got {spec.forced_name!r}',
                              param="tool_choice.function.name")
    else:
        raise bad_request('"tool_choice" must be "none", "auto", "required" or {"type": "function", "function": '
                          '{"name": ...}}', param="tool_choice")
    if spec.choice in ("required", "named") and not tools:
        raise bad_request(f'"tool_choice" {choice!r} needs "tools"', param="tool_choice")
    return spec


def prompt_texts(messages: list[dict], tools: list[dict]):
    """Every text of a chat that a template may write into its prompt: contents, thinking sent back (one
    text under two names), a tool result's call id and tool name, each history call's id, name and
    arguments (as the JSON they are written in), the tools' names and descriptions (their parameters
    count under limits.max_schema_chars)."""
    for m in messages:
        yield m["content"]
        yield m.get("thinking") or m.get("reasoning_content") or ""
        yield m.get("tool_call_id", "")
        yield m.get("name", "")
        for call in m.get("tool_calls", ()):
            yield call.get("id", "")
            yield call["function"]["name"]
            yield json.dumps(call["function"]["arguments"])
    for tool in tools:
        yield tool["function"]["name"]
        yield tool["function"]["description"]


def call_schema(name: str, parameters: dict) -> dict:
    """The JSON Schema of one call of ``name`` in the fallback form."""
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def forced_output(spec: ToolSpec) -> StructuredOutput | None:
    """The grammar a required or named tool_choice imposes: exactly one call of an allowed function."""
    if not spec.forced:
        return None
    calls = [call_schema(t["function"]["name"], t["function"]["parameters"]) for t in spec.tools
             if spec.choice == "required" or t["function"]["name"] == spec.forced_name]
    return StructuredOutput(json_schema=calls[0] if len(calls) == 1 else {"anyOf": calls})


# ---------------------------------------------------------------------------- history and prompt

def message_tool_fields(m: dict, where: str) -> dict:
    """A history message's tool parts, normalised: an assistant's ``tool_calls`` (arguments as objects;
    OpenAI sends them as JSON text) and a tool result's ``tool_call_id`` / ``name``."""
    out = {}
    calls = m.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise bad_request(f'"{where}.tool_calls" must be an array', param=where + ".tool_calls")
        normal = []
        for j, call in enumerate(calls):
            at = f"{where}.tool_calls[{j}].function"
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
                raise bad_request(f'"{at}.name" is required', param=at + ".name")
            arguments = function.get("arguments", {})
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments) if arguments.strip() else {}
                except json.JSONDecodeError:
                    raise bad_request(f'"{at}.arguments" must be a JSON object', param=at + ".arguments") from None
            if not isinstance(arguments, dict):
                raise bad_request(f'"{at}.arguments" must be a JSON object', param=at + ".arguments")
            entry = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
            if isinstance(call.get("id"), str):
                entry["id"] = call["id"]
            normal.append(entry)
        out["tool_calls"] = normal
    for key, to in (("tool_call_id", "tool_call_id"), ("tool_name", "name"), ("name", "name")):
        if isinstance(m.get(key), str) and m[key]:
            out[to] = m[key]
    return out


def template_handles_tools(model, budget: WorkBudget, template: str | None = None) -> bool:
    """Whether the chat template (``template``, a preset's, else the model's own) renders a ``tools``
    variable at all; asked of a template child within ``budget``."""
    source = template if template is not None else model.template_source
    try:
        return template_runner.handles_tools(budget, source, model.tokenizer.bos_token, model.tokenizer.eos_token)
    except TemplateError:
        return False


def fallback_messages(messages: list[dict], spec: ToolSpec) -> list[dict]:
    """The conversation for a template without tools: the tools in the system prompt, past calls
    written as the JSON the model is asked to write."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
                     for c in m["tool_calls"]]
            m = {**m, "content": "\n".join(filter(None, [m.get("content", "")] + calls))}
        out.append({k: v for k, v in m.items() if k in ("role", "content")})
    if spec.active:
        listing = "\n".join(json.dumps(t["function"]) for t in spec.tools)
        section = FALLBACK_INSTRUCTIONS.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + section}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def render_messages(model, messages: list[dict], spec: ToolSpec, budget: WorkBudget,
                    template: str | None = None) -> tuple[list[dict], dict]:
    """(messages, extra template variables) to render this conversation with its tools."""
    needs_tools = spec.active or any(m.get("tool_calls") for m in messages)
    if not needs_tools:
        return messages, {}
    if template_handles_tools(model, budget, template):
        return messages, ({"tools": spec.tools} if spec.active else {})
    return fallback_messages(messages, spec), {}


def encode_chat_with_tools(model, messages: list[dict], spec: ToolSpec, budget: WorkBudget,
                           template: str | None = None, **variables) -> list[int]:
    """Token ids of a chat with its tools, through `template` (a model preset's TEMPLATE) or the model's own;
    ``variables``: more template variables (``enable_thinking``)."""
    messages, extra = render_messages(model, messages, spec, budget, template)
    return encode_with_template(model, messages, template, budget, **extra, **variables)


# ---------------------------------------------------------------------------- the reply

def parse_calls(text: str, spec: ToolSpec) -> list[dict] | None:
    """The tool calls ``text`` makes (``{"name", "arguments"}`` each), or None when it is not a call."""
    tagged = TOOL_CALL_TAG.findall(text)
    candidates = tagged if tagged else [text.strip()]
    calls = []
    for raw in candidates:
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            return None
        for call in value if isinstance(value, list) else [value]:
            if not isinstance(call, dict) or call.get("name") not in spec.names():
                return None
            arguments = call.get("arguments", call.get("parameters", {}))
            if not isinstance(arguments, dict):
                return None
            calls.append({"name": call["name"], "arguments": arguments})
    return calls or None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ReplyFilter:
    """Holds back a streamed reply while it may still be a tool call; passes other text through.

    ``feed(text)`` returns the text to send now; ``finish()`` the rest and the calls (None if none)."""

    def __init__(self, spec: ToolSpec):
        self.spec = spec
        self.held = ""
        self.passing = not spec.active

    def feed(self, text: str) -> str:
        if self.passing:
            return text
        self.held += text
        start = self.held.lstrip()
        if self.spec.forced or not start or any(s.startswith(start[:len(s)]) for s in CALL_STARTS):
            return ""
        self.passing = True
        text, self.held = self.held, ""
        return text

    def finish(self) -> tuple[str, list[dict] | None]:
        if self.passing:
            return "", None
        calls = parse_calls(self.held, self.spec)
        return ("", calls) if calls else (self.held, None)
