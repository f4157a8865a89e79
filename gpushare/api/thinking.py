"""Thinking models, for every dialect: which models think, thinking on or off, its budget, and the
split of a reply into its thinking and its answer.

A model thinks when its chat template takes ``enable_thinking`` or writes ``<think>`` (Qwen3, the
DeepSeek-R1 distills) and ``</think>`` is one token of its vocabulary. Thinking off renders the
template with ``enable_thinking=False`` (the template then closes an empty thinking block itself).
A reply is thinking up to ``</think>`` (less an opening ``<think>``, which the template may already
have written in the prompt) and answer after it, leading whitespace of each dropped, as Ollama does.

A budget, or a grammar the answer must follow (JSON Schema, forced tool calls), becomes one Lark
grammar: free text of at most ``budget`` tokens, the ``</think>`` token (forced once the budget is
spent), then the answer's grammar, so constrained decoding starts where the thinking ends.
gpt-oss's channels are not split: such a model has no ``thinking`` capability here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from gpushare.api.errors import bad_request
from gpushare.protocol.structured_output import JSON_OPTIONS, StructuredOutput

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# Ollama's and OpenAI's effort levels, as budgets of thinking tokens ("high": no budget but max_tokens).
EFFORT_BUDGETS = {"minimal": 256, "low": 1024, "medium": 4096, "high": None}


@dataclass
class Thinking:
    """What a request asks of a model's thinking: ``enabled`` None leaves the template's default."""
    enabled: bool | None = None
    budget_tokens: int | None = None
    param: str = "think"  # the field that asked, as the dialect names it (for 400s)
    strict: bool = True  # asking a model that cannot think is a 400 (else the request is answered plainly)


def close_token(model) -> int | None:
    """The id of the model's ``</think>`` token, or None when it has none."""
    return model.tokenizer.token_to_id(THINK_CLOSE)


def template_thinks(source: str | None) -> bool:
    """Whether a chat template is a thinking model's (/api/show's ``thinking`` capability)."""
    return "enable_thinking" in (source or "") or THINK_OPEN in (source or "")


def can_think(model, template: str | None = None) -> bool:
    """Whether the model (with ``template``, a preset's TEMPLATE, replacing its own) thinks."""
    return template_thinks(template or model.template_source) and close_token(model) is not None


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
        return Thinking(True, EFFORT_BUDGETS[value], param=param, strict=strict)
    raise bad_request(f'"{param}" must be true, false, "low", "medium" or "high", got {json.dumps(value)}',
                      param=param)


def checked(thinking: Thinking, model, template: str | None, model_name: str) -> Thinking:
    """The request's thinking for this model: 400 when it asks a model that cannot think to, as Ollama
    answers (unless not ``strict``); a request that leaves it unset on such a model is plain."""
    if thinking.enabled and thinking.strict and not can_think(model, template):
        raise bad_request(f'"{model_name}" does not support thinking', param=thinking.param)
    if not can_think(model, template):
        return Thinking(False, param=thinking.param)
    return thinking


def template_vars(thinking: Thinking) -> dict:
    """The chat template's variables for this request (Qwen3's ``enable_thinking``)."""
    return {} if thinking.enabled is None else {"enable_thinking": thinking.enabled}


def thinks(thinking: Thinking, model, template: str | None) -> bool:
    """Whether this reply is to be split: a thinking model, thinking not turned off."""
    return thinking.enabled is not False and can_think(model, template)


def opens_thinking(model, prompt_ids: list[int]) -> bool:
    """Whether the prompt itself opened the thinking (R1's templates end with ``<think>``)."""
    return model.tokenizer.decode(prompt_ids[-4:], skip_special_tokens=False).rstrip().endswith(THINK_OPEN)


def grammar(model, thinking: Thinking, answer: StructuredOutput | None) -> StructuredOutput | None:
    """The grammar of a thinking reply: None when neither a budget nor the answer constrain it."""
    if thinking.budget_tokens is None and answer is None:
        return None
    budget = f"[max_tokens={thinking.budget_tokens}]" if thinking.budget_tokens is not None else ""
    rest = "/(?s:.*)/" if answer is None else "%json " + json.dumps({"x-guidance": JSON_OPTIONS, **answer.schema()})
    return StructuredOutput(lark=f"start: think <[{close_token(model)}]> answer\n"
                                 f"think{budget}: /(?s:.*)/\nanswer: {rest}\n")


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


def split(text: str, active: bool, opened: bool = False) -> tuple[str, str]:
    """A whole reply as (thinking, answer)."""
    splitter = ThinkSplit(active, opened)
    first = splitter.feed(text)
    last = splitter.finish()
    return first[0] + last[0], first[1] + last[1]
