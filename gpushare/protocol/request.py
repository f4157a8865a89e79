"""What crosses the API -> engine boundary: one GenerationRequest (or EmbedRequest) per request,
built once by its caller after one validator, ``check_request``, has fixed its limits.

The max_tokens rule (the same for Ollama, OpenAI and the offline API): a request generates
at most the number of tokens it asks for (``num_predict``, ``max_tokens``,
``max_completion_tokens``), else up to the end of its usable context. The usable context is the
least of the model's context length, the request's ``num_ctx``, the tokens the device's KV pool
can hold for this model and the tenant's ``kv_limit`` in tokens. A request that asks for more than
the usable context leaves is clipped to it when ``clip`` is set (Ollama: generation just stops at
the context) and refused otherwise (OpenAI, as vLLM, and the offline API).

The errors the engine raises back across the boundary (RequestError, EngineFailed, KVCacheBusy) are
here too, so that the API, in a supervisor process that never imports torch, can catch them.
"""

from __future__ import annotations

import array
import uuid
from dataclasses import dataclass, field

from gpushare.protocol.sampling_params import SamplingParams
from gpushare.protocol.tenant_policy import DEFAULT_TENANT, PRIORITIES, TenantPolicy


class RequestError(ValueError):
    """A request that can never run; ``field`` names the request field at fault (engine names:
    prompt, max_tokens, n, priority), for the API to translate into its dialect's."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


class EngineFailed(RuntimeError):
    """The engine loop stopped after an internal error and takes no more requests."""


class KVCacheBusy(RuntimeError):
    """The blocks a request needs now are held by requests it may not preempt."""


@dataclass
class GenerationRequest:
    model: str
    prompt_ids: list[int]
    params: SamplingParams  # params.max_tokens is the effective one (check_request)
    tenant: str = DEFAULT_TENANT
    priority: str | None = None  # this request's own (interactive | batch); None: its tenant's
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    fair_group: str = ""  # a fair-share group inside the tenant (a trusted gateway's fairness id); "": none


@dataclass
class EmbedRequest:
    model: str
    inputs: list[list[int]]
    tenant: str = DEFAULT_TENANT
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    type_ids: list[list[int]] | None = None  # per input token types: a cross-encoder's (query, document) pairs
    task: str = "embed"  # "embed": one vector per input; "score": one relevance score (a cross-encoder)
    dimensions: int | None = None  # Matryoshka: each vector's first ``dimensions`` values, L2-normalised again


@dataclass
class Vectors:
    """An embed request's answer across the boundary: one float32 vector per input, kept in one flat
    array (4,000 vectors of 384 pickle as one buffer in about a millisecond, where lists of floats took
    ~100 ms of the supervisor's lock on Python)."""
    width: int
    values: array.array  # typecode "f": len(self) x width

    def __len__(self) -> int:
        return len(self.values) // self.width if self.width else 0

    def __getitem__(self, i: int) -> array.array:
        i = range(len(self))[i]
        return self.values[i * self.width:(i + 1) * self.width]

    def tolist(self) -> list[list[float]]:
        return [self[i].tolist() for i in range(len(self))]


@dataclass(frozen=True)
class ModelLimits:
    """What a request on one model may hold, from the model and its engine's latest snapshot."""
    vocab_size: int
    context_length: int
    pool_tokens: int  # tokens of this model's blocks the whole device KV pool holds
    block_size: int
    bytes_per_token: int  # of this model's KV cache
    max_num_seqs: int


@dataclass(frozen=True)
class RequestLimits:
    context_tokens: int  # the usable context: prompt plus generated tokens stay within it
    max_tokens: int  # the effective max_tokens (the rule above)


def model_limits(context_length: int, vocab_size: int, stats, max_num_seqs: int) -> ModelLimits:
    """From the model's config and its ModelStats in an engine snapshot. A model without a KV cache
    (an encoder: block_bytes 0) is bounded by its context alone."""
    pool_tokens = stats.blocks_total * stats.block_size if stats.block_bytes else context_length
    return ModelLimits(vocab_size, context_length, pool_tokens, stats.block_size,
                       stats.block_bytes // stats.block_size, max_num_seqs)


def tenant_limit_bytes(policies: dict, tenant: str, limits: ModelLimits) -> int | None:
    """The tenant's kv_limit in bytes of this model's KV (None: no limit); `policies`: name -> TenantPolicy."""
    policy = policies.get(tenant) or TenantPolicy(tenant)
    return policy.limit_bytes(limits.bytes_per_token)


def usable_context(limits: ModelLimits, num_ctx: int | None = None, tenant_limit_bytes: int | None = None) -> int:
    """The most tokens one request may hold (prompt plus answer): see the module docstring."""
    tokens = min(limits.context_length, num_ctx or limits.context_length, limits.pool_tokens)
    if tenant_limit_bytes is not None and limits.bytes_per_token:
        tenant_tokens = tenant_limit_bytes // limits.bytes_per_token
        tokens = min(tokens, tenant_tokens - tenant_tokens % limits.block_size)
    return tokens


def check_request(prompt_ids: list[int], params: SamplingParams, limits: ModelLimits, *, num_ctx: int | None = None,
                  tenant_limit_bytes: int | None = None, tenant: str = DEFAULT_TENANT, priority: str | None = None,
                  clip: bool = False) -> RequestLimits:
    """The request's effective limits; ValueError naming what is wrong when it can never run.
    ``params`` must have passed ``SamplingParams.validate``."""
    if priority is not None and priority not in PRIORITIES:
        raise RequestError(f"priority must be one of {', '.join(PRIORITIES)}, got {priority!r}", "priority")
    if not prompt_ids:
        raise RequestError("the prompt is empty", "prompt")
    if params.n > limits.max_num_seqs:
        raise RequestError(f"n must be at most engine.max_num_seqs ({limits.max_num_seqs}), got {params.n}", "n")
    context = usable_context(limits, num_ctx, tenant_limit_bytes)
    if len(prompt_ids) >= context:
        raise RequestError(f"the prompt is {len(prompt_ids)} tokens, and the usable context is {context} tokens "
                           f"({_context_parts(limits, num_ctx, tenant_limit_bytes, tenant)})", "prompt")
    # Walked only once its length is known to fit: the caller's thread (the daemon's event loop) waits.
    if any(not isinstance(t, int) or not 0 <= t < limits.vocab_size for t in prompt_ids):
        raise RequestError(f"the prompt has token ids outside the vocabulary [0, {limits.vocab_size})", "prompt")
    room = context - len(prompt_ids)
    max_tokens = params.max_tokens
    if max_tokens is None or (clip and max_tokens > room):
        max_tokens = room
    elif max_tokens > room:
        parts = _context_parts(limits, num_ctx, tenant_limit_bytes, tenant)
        raise RequestError(f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                           f"usable context of {context} tokens ({parts})", "max_tokens")
    blocks = -(-(len(prompt_ids) + max_tokens) // limits.block_size)
    shared = len(prompt_ids) // limits.block_size  # n answers share the prompt's full blocks (forks.py)
    pool_blocks = limits.pool_tokens // limits.block_size
    if shared + params.n * (blocks - shared) > pool_blocks:
        raise RequestError(f"n ({params.n}) answers of max_tokens ({max_tokens}) tokens need more KV cache than "
                           f"the whole pool ({limits.pool_tokens} tokens)", "n")
    return RequestLimits(context, max_tokens)


def check_embed(inputs: list[list[int]], limits: ModelLimits, tenant_limit_bytes: int | None = None,
                tenant: str = DEFAULT_TENANT) -> None:
    """ValueError naming the first input that can never be embedded (each runs as one forward pass)."""
    if not inputs:
        raise ValueError("no input to embed")
    context = usable_context(limits, None, tenant_limit_bytes)
    for i, ids in enumerate(inputs):
        if not ids:
            raise ValueError(f"input {i} is empty")
        if not all(isinstance(t, int) for t in ids) or min(ids) < 0 or max(ids) >= limits.vocab_size:
            raise ValueError(f"input {i} has token ids outside the vocabulary [0, {limits.vocab_size})")
        if len(ids) > context:
            raise ValueError(f"input {i} is {len(ids)} tokens, and the usable context is {context} tokens "
                             f"({_context_parts(limits, None, tenant_limit_bytes, tenant)})")


def _context_parts(limits: ModelLimits, num_ctx: int | None, tenant_limit_bytes: int | None, tenant: str) -> str:
    parts = [f"model context {limits.context_length}", f"KV pool {limits.pool_tokens} (memory.kv_budget)"]
    if num_ctx:
        parts.append(f"num_ctx {num_ctx}")
    if tenant_limit_bytes is not None and limits.bytes_per_token:
        parts.append(f"kv_limit ({tenant_limit_bytes // limits.bytes_per_token} tokens) of tenant {tenant!r}")
    return "the least of " + ", ".join(parts)
