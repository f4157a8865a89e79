"""Every Triton kernel the engine launches compiles for real GPUs and fits them, without a GPU here.

benchmarks/kernel_compile.py drives the GPU dispatch code (models/triton_warmup.py's buckets over a
matrix of layer shapes, and LoRA), records each launch, and compiles it with ``triton.compile`` for
sm_80, sm_86, sm_89 and sm_90 (sm_100 in the slow full matrix) down to a cubin with the wheel's
``ptxas``. What a user with that GPU would see: the kernel compiles, and its launch fits the arch's
shared memory and registers (else "out of resources" at the first step). The interpreter, which
every other kernel test runs under, accepts code compiled Triton refuses.
"""

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import kernel_compile  # noqa: E402

from gpushare.kernels import lora_triton, paged_attention_triton, quant_matmul_triton  # noqa: E402

# Stack bytes a thread (spills: cuobjdump -res-usage) a kernel may have on any arch, as the full matrix
# measured them (docs/benchmarks.md): a few bytes on the GPU's bfloat16/float16 path (decode 8 B at
# 64 dims, prefill 16 B); on the exact float32 path more: the int8 and int4 matmuls on float32
# activations (UPCAST: fp32 FMA dots) 0.2-10.7 KiB, and float32 attention (PRECISION ieee) up to
# 5.6 KiB (decode, 256 dims, sm_90/sm_100) and 320 B (prefill, 64 dims, sm_80).
SPILL_BUDGET_BYTES = {
    "_reshape_and_cache_kernel": 0,
    "_decode_segment_kernel": 16,
    "_decode_merge_kernel": 0,
    "_prefill_kernel": 64,
    "_int8_matmul_kernel": 0,
    "_int4_matmul_kernel": 0,
    "_lora_kernel": 0,
}
UPCAST_MATMUL_SPILL_BUDGET_BYTES = 12 * 1024
FLOAT32_ATTENTION_SPILL_BUDGET_BYTES = 8 * 1024


def _spill_budget(result: dict) -> int:
    if result["constexprs"].get("UPCAST") == "True":
        return UPCAST_MATMUL_SPILL_BUDGET_BYTES
    if result["kernel"] in ("_decode_segment_kernel", "_prefill_kernel") and result["constexprs"].get("PRECISION") == "ieee":
        return FLOAT32_ATTENTION_SPILL_BUDGET_BYTES
    return SPILL_BUDGET_BYTES[result["kernel"]]


KERNEL_MODULES = (paged_attention_triton, quant_matmul_triton, lora_triton)


def _launched_kernels() -> set[str]:
    """The @triton.jit kernels of the dispatch modules (every ``*_kernel`` there is launched)."""
    return {name for module in KERNEL_MODULES for name, obj in vars(module).items()
            if name.endswith("_kernel") and hasattr(obj, "fn")}


def _check(results: list[dict], arches) -> None:
    assert results, "nothing compiled"
    broken = [f"sm_{r['arch']} {r['kernel']} {r['constexprs']} (warps {r['num_warps']}, stages {r['num_stages']}): "
              f"{'; '.join(kernel_compile.limit_errors(r))}" for r in results if kernel_compile.limit_errors(r)]
    assert not broken, "\n".join(broken)
    over = [f"sm_{r['arch']} {r['kernel']} {r['constexprs']}: {r['spill_bytes']} B spilled"
            for r in results if r["spill_bytes"] > _spill_budget(r)]
    assert not over, "\n".join(over)
    kernels = _launched_kernels()
    for arch in arches:
        on_arch = [r for r in results if r["arch"] == arch]
        assert {r["kernel"] for r in on_arch} == kernels
        # every tile config the dispatch can pick, and every decode bucket, compiled on every arch
        tiles = {(int(r["constexprs"]["BLOCK_M"]), r["kernel"]) for r in on_arch if "BLOCK_M" in r["constexprs"]}
        assert tiles == {(row[1], kernel) for row in quant_matmul_triton.TILE_CONFIGS
                         for kernel in ("_int8_matmul_kernel", "_int4_matmul_kernel")}
        merges = {int(r["constexprs"]["SEGMENTS_P2"]) for r in on_arch if r["kernel"] == "_decode_merge_kernel"}
        buckets = {paged_attention_triton.decode_bucket(w, 16) for w in paged_attention_triton.decode_bucket_widths(16)}
        assert merges == {p2 for direct, p2 in buckets if not direct}


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    return kernel_compile.run_sharded(full=False, jobs=2)


def test_every_kernel_compiles_and_fits_each_arch(compiled):
    _check(compiled, kernel_compile.DEFAULT_ARCHES)


@pytest.mark.slow
def test_full_matrix_compiles_and_fits_each_arch():
    """Every head dim, KV-head count, dtype pair and softcap, on sm_100 too."""
    _check(kernel_compile.run_sharded(full=True, jobs=2), tuple(kernel_compile.ARCHES))


# Run in a compiled-Triton process (this one runs the interpreter, whose kernels Triton cannot bind).
_SERVING = r"""
import json, random, sys, torch
sys.path.insert(0, "benchmarks")
import kernel_compile
from gpushare.kernels import paged_attention_triton as attention, quant_matmul_triton as quant
from gpushare.models import triton_warmup

rng = random.Random(0)
head_dim, q_heads, kv_heads = 64, 8, 2
cache = torch.zeros(64, 16, kv_heads, head_dim, dtype=torch.bfloat16)
linear = kernel_compile._Linear("int8")
with kernel_compile.recorded_launches() as warm:
    triton_warmup.attention_buckets(q_heads, torch.bfloat16, cache, cache.clone(), 0.125, 0, 0.0)
    triton_warmup.matmul_buckets(linear, torch.bfloat16)
with kernel_compile.recorded_launches() as serving:
    for step in range(300):  # what steps of a serving engine launch: any batch, table width, chunk
        batch, width, chunk = rng.randint(1, 64), rng.randint(1, 3000), rng.randint(2, 300)
        q = torch.zeros(batch + chunk, q_heads, head_dim, dtype=torch.bfloat16)
        tables = torch.zeros(batch, width, dtype=torch.int32)
        attention.decode_attention(q[chunk:], cache, cache, tables, torch.ones(batch, dtype=torch.int32), 0.125)
        attention.prefill_attention(q[:chunk], cache, cache, tables[:1], torch.tensor([0, chunk], dtype=torch.int32),
                                    torch.tensor([chunk + step], dtype=torch.int32), 0.125, rng.choice([0, 4096]))
        attention.reshape_and_cache(q[:chunk, :kv_heads], q[:chunk, :kv_heads], cache, cache,
                                    torch.arange(chunk, dtype=torch.long))
        quant.int8_weight_matmul(torch.zeros(rng.randint(1, 600), 512, dtype=torch.bfloat16), linear.qweight,
                                 linear.scales)
print(json.dumps({"warm": kernel_compile.launch_keys(warm), "serving": kernel_compile.launch_keys(serving)}))
"""


def test_buckets_bound_the_variants_and_warm_up_compiles_them_all():
    """Many steps of any batch, table width, chunk and window launch no kernel variant that the warm-up at
    model load does not compile, and the warm-up compiles a handful (none mid-serving on a GPU)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=root)
    out = subprocess.run([sys.executable, "-c", _SERVING], cwd=root, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    keys = json.loads(out.stdout.strip().splitlines()[-1])
    warm, serving = set(keys["warm"]), set(keys["serving"])
    assert serving <= warm, "\n".join(sorted(serving - warm))
    # cache write, prefill, the decode segments direct or not, 6 merge buckets, 4 tile configs
    assert len(warm) == 1 + 1 + 2 + 6 + len(quant_matmul_triton.TILE_CONFIGS)


_MODEL = r"""
import json, sys, torch
sys.path.insert(0, "benchmarks")
import kernel_compile
from gpushare.models.loader import load_model
from gpushare.models import triton_warmup

loaded = load_model(sys.argv[1], dtype="bfloat16", weights=sys.argv[2])
config = loaded.config
caches = [(torch.zeros(8, 16, config.num_kv_heads, config.head_dim, dtype=torch.bfloat16),) * 2
          for _ in range(config.num_layers)]
with kernel_compile.recorded_launches() as launches:
    triton_warmup.model_buckets(loaded.model, caches, torch.bfloat16)
print(json.dumps(kernel_compile.launch_keys(launches)))
"""


def test_warm_up_walks_a_real_model_to_a_few_variants(smollm2_path):
    """SmolLM2 with int8 weights, in the layout a GPU holds them: the warm-up reaches every kernel it
    runs (attention and its matmuls) in a handful of variants, its 30 layers sharing them. (int4 weights
    take another layout on the CPU, so a CPU model cannot stand in for a GPU's.)"""
    weights = "int8"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=root, GPUSHARE_KERNELS="triton")  # Triton's weights
    out = subprocess.run([sys.executable, "-c", _MODEL, smollm2_path, weights], cwd=root, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    keys = set(json.loads(out.stdout.strip().splitlines()[-1]))
    kernels = {json.loads(key)[0] for key in keys}
    assert kernels == {"_reshape_and_cache_kernel", "_prefill_kernel", "_decode_segment_kernel",
                       "_decode_merge_kernel", f"_{weights}_matmul_kernel"}
    matmuls = [key for key in keys if "matmul" in key]
    # every tile config, for each class of linear shape Triton tells apart (N, K divisible by 16 or not)
    assert len(matmuls) % len(quant_matmul_triton.TILE_CONFIGS) == 0 and 0 < len(matmuls) <= 4 * 4
    assert len(keys) - len(matmuls) == 1 + 1 + 2 + 6
