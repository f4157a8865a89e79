"""EngineConfig: one engine's settings (the daemon builds it from the YAML, the offline API from its
arguments), and the KV storage rule its ``kv_dtype`` is checked against. Torch-free: the daemon's
supervisor builds configs for its worker processes without loading torch."""

from dataclasses import dataclass

KV_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")


def kv_dtype_name(kv_dtype: str, device: str, weights: str = "auto") -> str:
    """The KV storage dtype's name for the ``engine.kv_dtype`` setting on ``device`` with the engine's
    default ``weights`` format; ValueError when the device cannot store it. ``auto``: bfloat16 on a
    GPU (the compute dtype there); on the CPU bfloat16 too (half the bytes a decode step reads, twice
    the tokens a pool holds: perplexity 22.515 vs 22.520 with float32 weights, docs/benchmarks.md),
    except under ``weights: float32``, the exact path, which keeps float32. The CPU's C++ attention
    computes a prompt's rows as the decode rows they would be, so a K/V row has the same bits from
    the prefix cache as computed afresh and rounding it to bfloat16 cannot make an answer depend on
    what ran before; where those kernels do not run, kv_pool.resolve_kv_dtype keeps float32. float16
    is refused on the CPU (no fast float16 kernels); int8 (a quarter of float32's bytes plus a scale
    per token and head) on GPUs, whose Triton kernels read float KV only."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"engine.kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    on_gpu = device.startswith("cuda")
    if kv_dtype == "float16" and not on_gpu:
        raise ValueError("engine.kv_dtype: float16 is for GPUs; on the CPU use bfloat16, int8 or float32")
    if kv_dtype == "int8" and on_gpu:
        raise ValueError("engine.kv_dtype: int8 runs on the CPU only; on a GPU use bfloat16, float16 or float32")
    if kv_dtype == "auto":
        return "bfloat16" if on_gpu or weights != "float32" else "float32"
    return kv_dtype


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
    kv_cache_bytes: int = 512 << 20  # the device KV pool, shared by every loaded model (on a GPU its least)
    device_margin_bytes: int = 2 << 30  # GPU memory the KV pool leaves free when it grows (engine/kv_sizing.py)
    kv_dtype: str = "auto"  # KV storage: auto | float32 | bfloat16 | float16 | int8 (kv_dtype_name)
    weights: str = "auto"  # the weight format models load in unless they say otherwise: picks auto's KV dtype
    kv_slab_blocks: int = 8  # KV pool slab size, in blocks of the first model loaded
    kv_idle_release_s: float = 30.0  # a model idle this long drops its cached KV and gives its slabs back

    def __post_init__(self):
        if self.prefix_cache not in ("tenant", "global", "off"):
            raise ValueError(f"prefix_cache must be tenant, global or off, got {self.prefix_cache!r}")
        kv_dtype_name(self.kv_dtype, self.device, self.weights)
