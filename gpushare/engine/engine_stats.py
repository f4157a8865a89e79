"""Snapshots of engine state for the API: per-model batches and KV use, per-tenant usage, liveness.

The engine builds one on its own thread after every loop turn (``Engine._publish``) and replaces
the previous one whole; other threads and processes only ever read a finished snapshot, never the
engine's live state. A worker process sends each one to the supervisor (engine/worker.py)."""

from dataclasses import dataclass, field

from gpushare.engine.tenants import TenantLedger, TenantStats


@dataclass
class TenantModelStats:
    """One tenant's share of one model: what /api/ps shows a tenant of a model others use too."""
    running: int = 0
    waiting: int = 0
    blocks_used: int = 0  # blocks charged to the tenant in this model's pool


@dataclass
class ModelStats:
    blocks_total: int  # blocks this model could hold with the whole device pool
    block_size: int
    blocks_used: int = 0
    running: int = 0
    waiting: int = 0
    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    cached_blocks: int = 0
    block_bytes: int = 0
    kv_committed_bytes: int = 0  # the device pool's slabs this model holds now
    tenants: dict[str, TenantModelStats] = field(default_factory=dict)


@dataclass
class EngineStats:
    steps: int
    models: dict[str, ModelStats] = field(default_factory=dict)
    kv_pool_bytes: int = 0  # the device KV pool's size
    kv_committed_bytes: int = 0  # slabs handed out to models
    kv_dtype: str = ""
    max_num_seqs: int = 0


@dataclass
class EngineSnapshot:
    stats: EngineStats
    tenants: dict[str, TenantStats]
    last_tick_s: float  # time.monotonic() of the loop's latest turn (the clock is system-wide)
    failure: str | None  # why the loop stopped for good, once it has


def has_work(stats: EngineStats, model_name: str | None = None) -> bool:
    """Whether the model (or, with None, any) had requests running or waiting in these stats."""
    models = stats.models
    chosen = [models[model_name]] if model_name in models else ([] if model_name else list(models.values()))
    return any(m.running or m.waiting for m in chosen)


def engine_stats(engine) -> EngineStats:
    pool = engine.kv_pool
    out = EngineStats(engine.steps, kv_pool_bytes=pool.capacity_bytes, kv_committed_bytes=pool.committed_bytes,
                      kv_dtype=str(engine.kv_dtype).removeprefix("torch."), max_num_seqs=engine.config.max_num_seqs)
    for name, w in list(engine.workers.items()):
        blocks = w.scheduler.pool
        out.models[name] = ModelStats(
            blocks_total=blocks.num_blocks, block_size=blocks.block_size, blocks_used=blocks.num_used,
            running=len(w.scheduler.running), waiting=len(w.scheduler.waiting), steps=w.steps,
            prompt_tokens=w.prompt_tokens, generated_tokens=w.generated_tokens,
            preemptions=w.scheduler.num_preemptions, cached_blocks=len(blocks.cached),
            block_bytes=blocks.block_bytes,
            kv_committed_bytes=sum(pool.slab_size(s) for s in list(blocks.slab_held)),
            tenants=_tenants_of_model(w.scheduler))
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
