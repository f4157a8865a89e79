"""Sequence: one request's state inside the engine (what its caller sees: protocol/outputs.RequestOutput)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from gpushare.engine.tenant_ledger import group_key
from gpushare.protocol.outputs import RequestOutput
from gpushare.protocol.sampling_params import SamplingParams, TokenLogprobs

if TYPE_CHECKING:  # the supervisor builds and reads sequences' outputs without torch
    import torch


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    model_name: str
    prompt_ids: list[int]
    params: SamplingParams
    on_output: Callable[[RequestOutput], None]
    tenant: str = "default"
    max_tokens: int = 0
    priority: str | None = None  # this request's own (a trusted gateway's objective); None: its tenant's
    fair_group: str = ""  # a fair-share group inside the tenant (a trusted gateway's fairness id)
    adapter: str | None = None  # the LoRA adapter model it runs with on model_name (engine/adapters.py); None: the base
    arrival_s: float = field(default_factory=time.monotonic)
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_cached: int = 0  # of which reused from the prefix cache
    block_table: list[int] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full blocks
    generator: torch.Generator | None = None
    first_token_time_s: float | None = None
    scheduled_time_s: float | None = None  # its first admission into a batch: the end of its queue time
    prompt_logprobs: list[dict[int, float] | None] | None = None  # filled as prefill chunks run, when asked for
    matcher: object | None = None  # the output grammar (gpushare.engine.constraints), when constrained
    last_logprobs: TokenLogprobs | None = None  # of the token sampled last, when params.logprobs asks
    index: int = 0  # of the request's n answers; answers 1..n-1 are forked from answer 0 after the prefill
    forks: list["Sequence"] = field(default_factory=list)  # answer 0's siblings, once forked
    stop_reason: str | None = None  # the stop string that ended it
    # Incremental detokenisation state (see Detokenizer in engine.py).
    text: str = ""
    emitted_chars: int = 0
    prefix_offset: int = 0
    read_offset: int = 0

    @property
    def fair_key(self) -> str:
        """Whose fair-share counter this sequence counts against: its tenant's, or a group's inside it.
        KV charges, limits and the prefix-cache scope stay the tenant's (``tenant``) whatever the group."""
        return group_key(self.tenant, self.fair_group)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the cache: the rest of the prompt, or the last sampled token."""
        return self.num_tokens - self.num_computed
