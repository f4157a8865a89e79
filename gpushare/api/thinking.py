"""Thinking models, for every dialect: which models think, thinking on or off, its budget, and the
split of a reply into its thinking and its answer.

Two formats. A ``<think>`` model's chat template takes ``enable_thinking`` or writes ``<think>`` (Qwen3,
the DeepSeek-R1 distills) and ``</think>`` is one token of its vocabulary. Thinking off renders the
template with ``enable_thinking=False`` (the template then closes an empty thinking block itself). A
reply is thinking up to ``</think>`` (less an opening ``<think>``, which the template may already have
written in the prompt) and answer after it, leading whitespace of each dropped, as Ollama does.

A channel model (gpt-oss, api/channels.py) writes its thinking in the ``analysis`` channel and its
answer in ``final``; the reply's special tokens are kept in its text (SamplingParams.skip_special_tokens)
so the split sees them. It takes an effort, not on/off: the template reads ``reasoning_effort``
(``low | medium | high``; ``minimal`` is ``low``), and thinking off is not possible: as Ollama does, a
request that turns it off is answered with the thinking on (split as usual).

An effort is also a budget of thinking tokens (EFFORT_BUDGETS). A budget, or a grammar the answer must
follow (JSON Schema, forced tool calls), becomes one Lark grammar: free text of at most ``budget`` tokens,
the close (``</think>``; for channels ``<|end|><|start|>assistant<|channel|>final<|message|>``, after an
opening ``<|channel|>analysis<|message|>``), forced once the budget is spent, then the answer's grammar, so
constrained decoding starts where the thinking ends.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from gpushare.api import channels
from gpushare.api.errors import bad_request
from gpushare.protocol.structured_output import JSON_OPTIONS, StructuredOutput

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# Ollama's and OpenAI's effort levels, as budgets of thinking tokens ("high": no budget but max_tokens).
EFFORT_BUDGETS = {"minimal": 256, "low": 1024, "medium": 4096, "high": None}
CHANNEL_EFFORTS = {"minimal": "low"}  # gpt-oss's template knows low, medium and high


@dataclass
class Thinking:
    """What a request asks of a model's thinking: ``enabled`` None leaves the template's default."""
    enabled: bool | None = None
    budget_tokens: int | None = None
    param: str = "think"  # the field that asked, as the dialect names it (for 400s)
    strict: bool = True  # asking a model that cannot think is a 400 (else the request is answered plainly)
    level: str | None = None  # the effort asked ("low", ...), for a template that reads reasoning_effort
    raw: bool = False  # a raw prompt (Ollama's raw): the reply is never split


def close_token(model) -> int | None:
    """The id of the model's ``</think>`` token, or None when it has none."""
    return model.tokenizer.token_to_id(THINK_CLOSE)


def _template_opens_think(source: str | None) -> bool:
    return "enable_thinking" in (source or "") or THINK_OPEN in (source or "")


def template_thinks(source: str | None) -> bool:
    """Whether a chat template is a thinking model's (/api/show's ``thinking`` capability)."""
    return _template_opens_think(source) or channels.template_speaks(source)


def can_think(model, template: str | None = None) -> bool:
    """Whether the model (with ``template``, a preset's TEMPLATE, replacing its own) thinks."""
    return ((_template_opens_think(template or model.template_source) and close_token(model) is not None)
            or channels.speaks_channels(model, template))


def effort(value, param: str, strict: bool = True) -> Thinking:
    """``true | false | "minimal" | "low" | "medium" | "high"`` (Ollama's think, OpenAI's reasoning effort;
    ``strict`` False: OpenAI clients send an effort to every model, so a model that cannot think ignores it)."""
    if value is None:
        return Thinking(param=param)
    if isinstance(value, bool):
        return Thinking(value, param=param, strict=strict)
    if value == "none":
        return Thinking(False, param=param)
    if value in EFFORT_BUDGETS:
        return Thinking(True, EFFORT_BUDGETS[value], param=param, strict=strict, level=value)
    raise bad_request(f'"{param}" must be true, false, "low", "medium" or "high", got {json.dumps(value)}',
                      param=param)


def checked(thinking: Thinking, model, template: str | None, model_name: str) -> Thinking:
    """The request's thinking for this model: 400 when it asks a model that cannot think to, as Ollama
    answers (unless not ``strict``); a request that leaves it unset on such a model is plain."""
    if thinking.enabled and thinking.strict and not can_think(model, template):
        raise bad_request(f'"{model_name}" does not support thinking', param=thinking.param)
    if thinking.raw or not can_think(model, template):
        return Thinking(False, param=thinking.param, raw=thinking.raw)
    if thinking.enabled is False and channels.speaks_channels(model, template):
        return Thinking(param=thinking.param)  # gpt-oss cannot stop thinking: answered with it on, as Ollama does
    return thinking


def template_vars(thinking: Thinking) -> dict:
    """The chat template's variables for this request (Qwen3's ``enable_thinking``, gpt-oss's
    ``reasoning_effort``; a template reads the one it knows)."""
    values = {} if thinking.enabled is None else {"enable_thinking": thinking.enabled}
    if thinking.level is not None and thinking.enabled:
        values["reasoning_effort"] = CHANNEL_EFFORTS.get(thinking.level, thinking.level)
    return values


@dataclass(frozen=True)
class ReplyShape:
    """How a reply is split: ``style`` "plain" (not at all), "think" (at ``</think>``; ``opened``: the prompt
    opened the thinking) or "channels" (gpt-oss's)."""
    style: str = "plain"
    opened: bool = False

    @property
    def thinks(self) -> bool:
        return self.style != "plain"

    def splitter(self):
        """A fresh streaming splitter of this shape: ``feed(text)`` and ``finish()`` give (thinking, answer)."""
        return channels.ChannelSplit() if self.style == "channels" else ThinkSplit(self.thinks, self.opened)


@dataclass
class Plan:
    """A thinking request made concrete for the engine: the reply's shape, its grammar, and what it adds to
    the sampling parameters."""
    shape: ReplyShape
    structured: StructuredOutput | None
    sampling: dict = field(default_factory=dict)


def plan(thinking: Thinking, model, template: str | None, prompt_ids: list[int],
         answer: StructuredOutput | None) -> Plan:
    """The plan of a ``checked`` request whose prompt is ``prompt_ids``; ``answer``: the answer's grammar."""
    if thinking.enabled is False or thinking.raw or not can_think(model, template):
        return Plan(ReplyShape(), answer)
    if channels.speaks_channels(model, template):
        # The stops (<|return|>, <|call|>, never <|end|>) are the model's own (catalog/model_head.stop_ids).
        return Plan(ReplyShape("channels"), _grammar(model, thinking, answer, speaks=True),
                    {"skip_special_tokens": False})
    opened = model.tokenizer.decode(prompt_ids[-4:], skip_special_tokens=False).rstrip().endswith(THINK_OPEN)
    return Plan(ReplyShape("think", opened), _grammar(model, thinking, answer, speaks=False))


def _tokens(ids: list[int]) -> str:
    return " ".join(f"<[{i}]>" for i in ids)


def _grammar(model, thinking: Thinking, answer: StructuredOutput | None, speaks: bool) -> StructuredOutput | None:
    """The grammar of a thinking reply (``speaks``: in channels): None when neither a budget nor the answer
    constrain it."""
    if thinking.budget_tokens is None and answer is None:
        return None
    budget = f"[max_tokens={thinking.budget_tokens}]" if thinking.budget_tokens is not None else ""
    rest = "/(?s:.*)/" if answer is None else "%json " + json.dumps({"x-guidance": JSON_OPTIONS, **answer.schema()})
    if speaks:  # the answer may end with <|return|>, which the grammar then ends on
        start = (f"{_tokens(channels.open_ids(model))} think {_tokens(channels.close_ids(model))} answer "
                 f"{_tokens(channels.stop_ids(model)[:1])}?")
    else:
        start = f"think <[{close_token(model)}]> answer"
    return StructuredOutput(lark=f"start: {start}\nthink{budget}: /(?s:.*)/\nanswer: {rest}\n")


class ThinkSplit:
    """A reply split as it streams: ``feed(text)`` and ``finish()`` give ``(thinking, answer)`` deltas,
    a possible ``</think>`` held back until it is whole."""

    def __init__(self, active: bool, opened: bool = False):
        self.state = "answer" if not active else "thinking" if opened else "start"
        self.held = ""
        self.strip = active  # the leading whitespace of the part now streaming is dropped

    def feed(self, text: str) -> tuple[str, str]:
        if self.state == "answer" and not self.strip:
            return "", text
        self.held += text
        if self.state == "start":
            head = self.held.lstrip()
            if len(head) < len(THINK_OPEN) and THINK_OPEN.startswith(head):
                return "", ""
            if not head.startswith(THINK_OPEN):  # no thinking: all of it is the answer
                self.state, self.strip = "answer", False
                out, self.held = self.held, ""
                return "", out
            self.state, self.held = "thinking", head[len(THINK_OPEN):]
        if self.state == "thinking":
            return self._thinking()
        return "", self._answer()

    def _thinking(self) -> tuple[str, str]:
        if self.strip:
            self.held = self.held.lstrip()
            self.strip = not self.held
        end = self.held.find(THINK_CLOSE)
        if end >= 0:
            thought, self.held = self.held[:end], self.held[end + len(THINK_CLOSE):]
            self.state, self.strip = "answer", True
            return thought, self._answer()
        keep = next((k for k in range(len(THINK_CLOSE) - 1, 0, -1) if self.held.endswith(THINK_CLOSE[:k])), 0)
        thought, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return thought, ""

    def _answer(self) -> str:
        out, self.held = self.held.lstrip() if self.strip else self.held, ""
        self.strip = self.strip and not out
        return out

    def finish(self) -> tuple[str, str]:
        if self.state == "thinking":
            out, self.held = self.held, ""
            return out, ""
        out, self.held = self.held, ""
        return "", out.lstrip() if self.strip else out


def split(text: str, shape: ReplyShape) -> tuple[str, str]:
    """A whole reply as (thinking, answer)."""
    splitter = shape.splitter()
    first = splitter.feed(text)
    last = splitter.finish()
    return first[0] + last[0], first[1] + last[1]
