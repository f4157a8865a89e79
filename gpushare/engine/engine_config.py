"""EngineConfig: one engine's settings (the daemon builds it from the YAML, the offline API from its
arguments); ModelWorker: one loaded model's state inside the engine."""

from dataclasses import dataclass

from gpushare.engine.kv_pool import resolve_kv_dtype
from gpushare.engine.model_runner import ModelRunner
from gpushare.engine.scheduler import Scheduler
from gpushare.models.loader import LoadedModel


@dataclass
class EngineConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_threads: int | None = None  # torch intra-op threads for the engine; None keeps torch's choice
    idle_tick_s: float = 0.5  # how often an idle loop wakes (keeps the liveness stamp fresh)
    prefix_cache: str = "tenant"  # share cached prefix blocks within a tenant | "global" | "off"
    cpus: list[int] | None = None  # pin the engine thread (and torch's pool) to these CPUs
    device: str = "cpu"
    kv_cache_bytes: int = 512 << 20  # the device KV pool, shared by every loaded model
    kv_dtype: str = "auto"  # KV storage: auto | float32 | bfloat16 | float16 (kv_pool.resolve_kv_dtype)
    kv_slab_blocks: int = 8  # KV pool slab size, in blocks of the first model loaded
    kv_idle_release_s: float = 30.0  # a model idle this long drops its cached KV and gives its slabs back

    def __post_init__(self):
        if self.prefix_cache not in ("tenant", "global", "off"):
            raise ValueError(f"prefix_cache must be tenant, global or off, got {self.prefix_cache!r}")
        resolve_kv_dtype(self.kv_dtype, self.device)


@dataclass
class ModelWorker:
    name: str
    loaded: LoadedModel
    scheduler: Scheduler
    runner: ModelRunner
    share_weight: float = 1.0
    steps: int = 0
    virtual_steps: float = 0.0  # steps / share_weight, lifted when the model turns busy (fairness)
    prompt_tokens: int = 0
    generated_tokens: int = 0
