"""Checks a new request against its model, the model's KV pool and its tenant's kv_limit, on the
caller's thread, so that a request that can never run fails at once with a clear message."""

import uuid

import torch

from gpushare.engine import constraints
from gpushare.engine.kv_cache import BlockPool
from gpushare.engine.sampling import SamplingParams
from gpushare.engine.sequence import Sequence
from gpushare.engine.tenants import PRIORITIES, TenantLedger
from gpushare.models.loader import LoadedModel


def new_sequence(loaded: LoadedModel, pool: BlockPool, ledger: TenantLedger, model_name: str, prompt_ids: list[int],
                 params: SamplingParams, on_output, request_id: str | None, tenant: str,
                 priority: str | None = None) -> Sequence:
    """A sequence for the request; ValueError saying what is wrong when it cannot run."""
    params.validate()
    if priority is not None and priority not in PRIORITIES:
        raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, got {priority!r}")
    if not prompt_ids:
        raise ValueError("prompt is empty")
    vocab = loaded.config.vocab_size
    if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_ids):
        raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab})")
    context = loaded.config.context_length
    if len(prompt_ids) >= context:
        raise ValueError(f"prompt is {len(prompt_ids)} tokens, longer than the model's context of {context} tokens")
    room = min(context, pool.num_blocks * pool.block_size) - len(prompt_ids)
    max_tokens = params.max_tokens if params.max_tokens is not None else room
    if max_tokens < 1:
        raise ValueError(f"prompt is {len(prompt_ids)} tokens and leaves no room to generate in the KV "
                         f"cache pool ({pool.num_blocks * pool.block_size} tokens)")
    if len(prompt_ids) + max_tokens > context:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                         f"model's context of {context} tokens")
    if pool.blocks_for(len(prompt_ids) + max_tokens) > pool.num_blocks:
        raise ValueError(f"prompt plus max_tokens needs {len(prompt_ids) + max_tokens} tokens of KV cache, more "
                         f"than the whole pool ({pool.num_blocks * pool.block_size} tokens)")
    shared = len(prompt_ids) // pool.block_size  # n answers share the prompt's full blocks (forks.py)
    if shared + params.n * (pool.blocks_for(len(prompt_ids) + max_tokens) - shared) > pool.num_blocks:
        raise ValueError(f"n ({params.n}) answers of max_tokens ({max_tokens}) tokens need more KV cache than the "
                         f"whole pool ({pool.num_blocks * pool.block_size} tokens)")
    limit = ledger.policy(tenant).limit_bytes(pool.bytes_per_token)
    if limit is not None and pool.blocks_for(len(prompt_ids) + max_tokens) * pool.block_bytes > limit:
        raise ValueError(f"prompt plus max_tokens needs {len(prompt_ids) + max_tokens} tokens of KV cache, more "
                         f"than tenant {tenant!r}'s kv_limit ({limit // pool.bytes_per_token} tokens)")
    seq = Sequence(request_id or uuid.uuid4().hex, model_name, list(prompt_ids), params, on_output, tenant,
                   max_tokens=max_tokens, priority=priority)
    if params.prompt_logprobs is not None:
        seq.prompt_logprobs = [None]  # the first prompt token has nothing before it to be scored by
    if params.seed is not None:
        seq.generator = torch.Generator().manual_seed(params.seed)
    if params.structured is not None:
        seq.matcher = constraints.new_matcher(loaded, params.structured)  # SchemaError is a ValueError
    return seq
