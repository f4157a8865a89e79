"""One chat turn on the engine, for the dialects that answer with typed blocks (Anthropic's Messages,
OpenAI's Responses): the path chat completions take (tenant admission, the model's presets, the
prompt with its tools and thinking, the one GenerationRequest, the engine stream), and the reply's
parts (thinking, text, tool calls) as they stream or whole.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from aiohttp import web

from gpushare.api import thinking as think
from gpushare.api.context import context
from gpushare.api.embeddings import check_serves
from gpushare.api.model_defaults import chat_with_presets, fill_openai_values
from gpushare.api.streaming import EngineStream, Timings, checked_request, make_sampling_params
from gpushare.api.tenants import admit
from gpushare.api.tool_stream import CallStream
from gpushare.api.tools import ReplyFilter, ToolSpec, encode_chat_with_tools, forced_output, parse_calls
from gpushare.api.work import WorkBudget, bounded, budget_of
from gpushare.protocol.structured_output import StructuredOutput


@dataclass
class Turn:
    """A chat turn as the dialect asked it, parsed and checked."""
    model: str
    messages: list[dict]  # {"role", "content", tool_calls / tool_call_id}, as api/tools renders them
    values: dict  # sampling values by engine name (None: the default)
    tools: ToolSpec = field(default_factory=ToolSpec)
    structured: StructuredOutput | None = None
    thinking: think.Thinking = field(default_factory=think.Thinking)
    field_names: dict = field(default_factory=dict)  # engine field -> the dialect's name (for 400s)


@dataclass
class Running:
    """A turn submitted to the engine."""
    stream: EngineStream
    prompt_ids: list[int]
    shape: think.ReplyShape  # how its reply is split into thinking and answer
    tools: ToolSpec
    timings: Timings


def _prompt(loaded, preset, turn: Turn, thinking: think.Thinking, budget: WorkBudget) -> list[int]:
    return encode_chat_with_tools(loaded, chat_with_presets(preset, turn.messages), turn.tools, budget,
                                  preset.template, **think.template_vars(thinking))


async def count_prompt(request: web.Request, turn: Turn) -> int:
    """The prompt's token count, as the turn would be run. It is admitted as a generation is (the allow-list,
    requests_per_s, a max_concurrent slot): it renders, tokenises and may load the model. It generates
    nothing, so tokens_per_min is not charged."""
    async with admit(request, turn.model), context(request).registry.use(turn.model, None) as lease:
        check_serves(lease.model, turn.model, "chat")
        preset = lease.entry.source.preset
        thinking = think.checked(turn.thinking, lease.model, preset.template, turn.model)
        return len(await bounded(request, "rendering the chat template and tokenising the prompt", _prompt,
                                 lease.model, preset, turn, thinking, budget_of(request)))


@asynccontextmanager
async def running(request: web.Request, turn: Turn):
    """Run ``turn``; leaving the block before it finished cancels it (its KV blocks freed)."""
    ctx = context(request)
    timings = Timings()
    async with admit(request, turn.model) as ticket, ctx.registry.use(turn.model, None) as lease:
        check_serves(lease.model, turn.model, "chat")  # an embedding model or a reranker does not chat
        preset = lease.entry.source.preset
        values = dict(turn.values)
        explicit = values.get("max_tokens") is not None
        fill_openai_values(values, preset, explicit)
        thinking = think.checked(turn.thinking, lease.model, preset.template, turn.model)
        prompt_ids = await bounded(request, "rendering the chat template and tokenising the prompt", _prompt,
                                   lease.model, preset, turn, thinking, budget_of(request))
        plan = think.plan(thinking, lease.model, preset.template, prompt_ids,
                          forced_output(turn.tools) or turn.structured)
        params = make_sampling_params(turn.field_names, structured=plan.structured, **values, **plan.sampling)
        gen = checked_request(lease, prompt_ids, params, ticket.tenant, ticket.priority,
                              preset.options.get("num_ctx") or ctx.settings.server.context_length, clip=not explicit,
                              field_names=turn.field_names, policies=ctx.node.tenant_policies,
                              fair_group=ticket.fair_group)
        ticket.charge_tokens(len(prompt_ids) + gen.params.max_tokens, timings)
        lease.hold_tokens(len(prompt_ids) + gen.params.max_tokens)
        timings.submit_s = time.monotonic()
        with EngineStream(lease.device, gen) as stream:
            yield Running(stream, prompt_ids, plan.shape, turn.tools, timings)


@dataclass
class Reply:
    """A whole reply's parts."""
    thinking: str
    text: str
    calls: list[dict] | None  # {"name", "arguments"} each


def whole_reply(text: str, tools: ToolSpec, shape: think.ReplyShape) -> Reply:
    thought, answer = think.split(text, shape)
    calls = parse_calls(answer, tools) if tools.active else None
    return Reply(thought, "" if calls else answer, calls)


class ReplyStream:
    """A reply's parts as they stream: ``feed(text)`` and ``finish()`` give events
    ``("thinking", text)``, ``("text", text)``, ``("call", name)`` (a call begins), ``("arguments", text)``
    and, at the end, ``("calls", [...])`` for calls that were not streamed piece by piece."""

    def __init__(self, tools: ToolSpec, shape: think.ReplyShape):
        self.splitter = shape.splitter()
        self.held = ReplyFilter(tools)
        self.calls = CallStream(tools)
        self.tools = tools
        self.answer = ""  # every answer character so far
        self.called = False  # a tool call was sent

    def _answer(self, text: str) -> list[tuple]:
        self.answer += text
        call, piece = self.calls.feed(text)
        events = [("call", call.name)] if call else []
        if self.calls.call is not None:
            self.called = True
            return events + ([("arguments", piece)] if piece else [])
        shown = self.held.feed(text)
        return [("text", shown)] if shown else []

    def feed(self, text: str) -> list[tuple]:
        thought, answer = self.splitter.feed(text)
        return ([("thinking", thought)] if thought else []) + (self._answer(answer) if answer else [])

    def finish(self) -> list[tuple]:
        thought, answer = self.splitter.finish()
        events = ([("thinking", thought)] if thought else []) + (self._answer(answer) if answer else [])
        if self.calls.call is not None:
            return events
        rest, calls = self.held.finish()
        if calls:
            self.called = True
            return events + [("calls", calls)]
        return events + ([("text", rest)] if rest else [])
