"""Building an engine's stats from its live state, on the engine thread (the snapshot's types:
protocol/engine_stats.py)."""

from gpushare.engine.device_memory import device_memory
from gpushare.engine.tenant_ledger import TenantLedger
from gpushare.protocol.engine_stats import EngineStats, ModelStats, TenantModelStats
from gpushare.protocol.tenant_policy import TenantStats


def engine_stats(engine) -> EngineStats:
    pool = engine.kv_pool
    memory = device_memory(engine.config.device)
    out = EngineStats(engine.steps, kv_pool_bytes=pool.capacity_bytes, kv_committed_bytes=pool.committed_bytes,
                      kv_dtype=str(engine.kv_dtype).removeprefix("torch."), max_num_seqs=engine.config.max_num_seqs,
                      memory_kind=memory.kind, memory_used_bytes=memory.used_bytes,
                      memory_free_bytes=memory.free_bytes)
    for name, w in list(engine.models.items()):
        blocks = w.scheduler.pool
        out.models[name] = ModelStats(
            blocks_total=blocks.num_blocks, block_size=blocks.block_size, blocks_used=blocks.num_used,
            running=len(w.scheduler.running), waiting=len(w.scheduler.waiting), steps=w.steps,
            prompt_tokens=w.prompt_tokens, generated_tokens=w.generated_tokens,
            preemptions=w.scheduler.num_preemptions, cached_blocks=len(blocks.cached),
            block_bytes=blocks.block_bytes,
            kv_committed_bytes=sum(pool.slab_size(s) for s in list(blocks.slab_held)),
            tenants=_tenants_of_model(w.scheduler))
    for name, e in list(engine.encoders.items()):  # no KV: block_bytes 0 (request.model_limits)
        out.models[name] = ModelStats(blocks_total=0, block_size=engine.config.block_size, steps=e.steps,
                                      running=sum(p.model_name == name for p in list(engine.embeds.pending)),
                                      prompt_tokens=e.prompt_tokens)
    return out


def _tenants_of_model(scheduler) -> dict[str, TenantModelStats]:
    out: dict[str, TenantModelStats] = {}
    for seq in list(scheduler.running):
        out.setdefault(seq.tenant, TenantModelStats()).running += 1
    for seq in list(scheduler.waiting):
        out.setdefault(seq.tenant, TenantModelStats()).waiting += 1
    for tenant in list(scheduler.pool.held):
        out.setdefault(tenant, TenantModelStats()).blocks_used = scheduler.pool.tenant_blocks(tenant)
    return out


def tenant_stats(ledger: TenantLedger, schedulers: list) -> dict[str, TenantStats]:
    pools = [s.pool for s in schedulers]
    bytes_per_token = max((p.bytes_per_token for p in pools), default=0)
    names = set(ledger.policies) | set(ledger.used_bytes) | set(ledger.computed_tokens)
    out = {}
    for name in names:
        policy = ledger.policy(name)
        out[name] = TenantStats(kv_used_bytes=ledger.used_bytes.get(name, 0),
                                kv_reserved_bytes=policy.reserved_bytes(bytes_per_token),
                                kv_limit_bytes=policy.limit_bytes(bytes_per_token),
                                computed_tokens=ledger.computed_tokens.get(name, 0),
                                generated_tokens=ledger.generated_tokens.get(name, 0),
                                prefix_hit_tokens=ledger.prefix_hit_tokens.get(name, 0))
    for scheduler in schedulers:
        for seq in list(scheduler.running):
            out.setdefault(seq.tenant, TenantStats()).running += 1
        for seq in list(scheduler.waiting):
            out.setdefault(seq.tenant, TenantStats()).waiting += 1
    return out
