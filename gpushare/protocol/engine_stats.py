"""Snapshots of engine state for the API: per-model batches and KV use, per-tenant usage, liveness.

The engine builds one on its own thread after every loop turn (``Engine._publish``) and replaces
the previous one whole; other threads and processes only ever read a finished snapshot, never the
engine's live state. A worker process sends each one to the supervisor (engine/worker.py); the
engine's side that builds them is engine/engine_snapshot.py."""

from dataclasses import dataclass, field

from gpushare.protocol.tenant_policy import TenantStats


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
    # the device's memory as the engine sees it when the snapshot is built: "cuda" (mem_get_info: every
    # process on the GPU counts) or "host" (a CPU engine: the machine's RAM, used and available)
    memory_kind: str = ""
    memory_used_bytes: int = 0
    memory_free_bytes: int = 0


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
