"""Every Triton kernel the engine launches, compiled for real GPUs on a machine without one.

The GPU dispatch functions run over a matrix of layer shapes (models/triton_warmup.py's buckets:
the cache write, prefill, every decode bucket, every matmul tile bucket; and LoRA) with a hook in
place of Triton's launch that records each launch's arguments. Each distinct launch is then bound
and specialised by Triton's own JIT code (as a launch on that GPU would be) and compiled with
``triton.compile`` down to a cubin by the wheel's ``ptxas``, for each arch in ARCHES. The result per
launch: shared memory (Triton's metadata), registers and stack bytes (spills) a thread from the cubin
(``cuobjdump -res-usage``), or the error.

    python benchmarks/kernel_compile.py [--full] [--jobs 2]        # a table per kernel and arch
    python benchmarks/kernel_compile.py --json out.json [--full]   # the results, for tests/test_gpu_compile.py

The default matrix is a subset (every kernel, every decode and tile bucket, the widest head dim and
float32 activations on the matmuls, on each arch but sm_100); ``--full`` is every head dim, KV-head
count, dtype pair, softcap, int8 and int4 on each activation dtype, LoRA at three ranks, and sm_100.
"""

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile

# arch -> shared memory a block may opt in to, bytes (CUDA programming guide, compute capabilities)
ARCHES = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448}
DEFAULT_ARCHES = (80, 86, 89, 90)
REGISTERS_PER_SM = 65536
REGISTERS_PER_THREAD = 255
HEAD_DIMS = (64, 80, 96, 128, 256)
HEADS = ((8, 1), (32, 8))  # (query heads, KV heads): one KV head, and several
DTYPE_PAIRS = (("bfloat16", "bfloat16"), ("float16", "float16"), ("float32", "float32"), ("bfloat16", "float32"))


def _layers(full: bool):
    """(head_dim, q_heads, kv_heads, activation dtype, KV dtype, softcap) of the attention layers driven."""
    if full:
        return [(d, h, kv, a, c, cap) for d in HEAD_DIMS for h, kv in HEADS for a, c in DTYPE_PAIRS
                for cap in (0.0, 50.0)]
    # the widest (256 float32 dims, one KV head, softcap) and a common one (128 bfloat16 dims, GQA)
    return [(256, 8, 1, "bfloat16", "float32", 50.0), (128, 32, 8, "bfloat16", "bfloat16", 0.0)]


def _matmuls(full: bool):
    """(format, activation dtype) of the weight matmuls driven: every tile bucket each."""
    if full:
        return [(f, a) for f in ("int8", "int4") for a in ("bfloat16", "float16", "float32")]
    return [("int8", "float32"), ("int4", "bfloat16")]


@contextlib.contextmanager
def recorded_launches():
    """Kernel launches (JITFunction, args, kwargs) recorded in a list instead of run."""
    from triton.runtime import jit

    launches, real_run = [], jit.JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    jit.JITFunction.run = record
    try:
        yield launches
    finally:
        jit.JITFunction.run = real_run


class _Linear:
    """A quantized linear's weight as models/linear.Linear holds it (what matmul_buckets reads)."""

    def __init__(self, fmt: str, n: int = 256, k: int = 512, group_size: int = 32):
        import torch

        self.format, self.group_size = fmt, group_size
        self.qweight = torch.zeros(n, k if fmt == "int8" else k // 2, dtype=torch.int8 if fmt == "int8" else torch.uint8)
        self.scales = torch.ones(n) if fmt == "int8" else torch.ones(n, k // group_size)
        self.mins = None if fmt == "int8" else torch.zeros(n, k // group_size)


def drive(arch: int, full: bool) -> list:
    """The launches the dispatch code makes on ``arch`` for the matrix (the GPU's shared memory is
    what ``quant_matmul_triton`` asks the device for)."""
    import torch

    from gpushare.kernels import lora_triton, quant_matmul_triton
    from gpushare.models import triton_warmup

    real = quant_matmul_triton.shared_bytes_per_block
    quant_matmul_triton.shared_bytes_per_block = lambda device: ARCHES[arch]
    try:
        with recorded_launches() as launches:
            for head_dim, q_heads, kv_heads, dtype, kv_dtype, softcap in _layers(full):
                cache = torch.zeros(4, 16, kv_heads, head_dim, dtype=getattr(torch, kv_dtype))
                for window in (0, 4096):
                    triton_warmup.attention_buckets(q_heads, getattr(torch, dtype), cache, cache.clone(),
                                                    head_dim ** -0.5, window, softcap)
            for fmt, dtype in _matmuls(full):
                triton_warmup.matmul_buckets(_Linear(fmt), getattr(torch, dtype))
            for rank in ((8, 16, 64) if full else (16,)):
                for dtype in (torch.float32, torch.bfloat16):
                    y, x = torch.zeros(4, 512, dtype=dtype), torch.zeros(4, 256, dtype=dtype)
                    lora_triton.lora_apply(y, x, torch.zeros(2, rank, 256, dtype=dtype), torch.zeros(2, rank, 512, dtype=dtype),
                                           torch.tensor([0, 1, -1, 0]), torch.ones(2))
    finally:
        quant_matmul_triton.shared_bytes_per_block = real
    return launches


def _specialise(launch, backend):
    """(name, signature, constexprs, attrs, options) of ``launch`` as Triton's JIT binds it for ``backend``."""
    from triton import knobs
    from triton.runtime import jit

    fn, args, kwargs = launch
    kwargs = dict(kwargs, debug=kwargs.get("debug", fn.debug) or knobs.runtime.debug,
                  instrumentation_mode=knobs.compilation.instrumentation_mode,
                  fpsan_homomorphic_casts=knobs.compilation.fpsan_homomorphic_casts)
    binder = jit.create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    return fn._pack_args(backend, kwargs, bound, specialization, options)


def _resources(kernel) -> tuple[int, int]:
    """(registers a thread, stack bytes a thread: spills) of a compiled kernel, from its cubin
    (``cuobjdump -res-usage``: right for a kernel Triton's cache returns, unlike ptxas's log)."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", cubin.name], capture_output=True,
                               text=True, check=True).stdout
    return int(re.search(r"REG:(\d+)", usage).group(1)), int(re.search(r"STACK:(\d+)", usage).group(1))


def _key(fn, signature, consts, attrs, options) -> str:
    return json.dumps([fn.fn.__name__, signature, consts, repr(sorted(attrs.items())), options.num_warps,
                       options.num_stages], sort_keys=True)


def launch_keys(launches, arch: int = 90) -> list[str]:
    """Each launch's specialisation on ``arch``: two launches with the same key run one compiled kernel."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", arch, 32))
    keys = []
    for launch in launches:
        options, signature, constexprs, attrs = _specialise(launch, backend)
        fn = launch[0]
        keys.append(_key(fn, signature, {fn.arg_names[p[0]]: str(v) for p, v in constexprs.items()}, attrs, options))
    return keys


def compile_all(arch: int, full: bool, shard: int = 0, shards: int = 1) -> list[dict]:
    """Compile every distinct launch of the matrix for ``arch`` (this shard's share): one dict each."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    seen, results = set(), []
    for launch in drive(arch, full):
        options, signature, constexprs, attrs = _specialise(launch, backend)
        fn = launch[0]
        consts = {fn.arg_names[path[0]]: str(v) for path, v in constexprs.items()}
        key = _key(fn, signature, consts, attrs, options)
        if key in seen:
            continue
        seen.add(key)
        if (len(seen) - 1) % shards != shard:
            continue
        result = {"kernel": fn.fn.__name__, "arch": arch, "num_warps": options.num_warps,
                  "num_stages": options.num_stages, "signature": signature, "constexprs": consts}
        try:
            kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
            result["shared_bytes"] = kernel.metadata.shared
            result["registers"], result["spill_bytes"] = _resources(kernel)
        except Exception as e:  # what a launch on that GPU would raise
            result["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        results.append(result)
    return results


def limit_errors(result: dict) -> list[str]:
    """How a compiled launch breaks its arch's limits (empty: it fits)."""
    if "error" in result:
        return [result["error"]]
    errors = []
    if result["shared_bytes"] > ARCHES[result["arch"]]:
        errors.append(f"shared memory {result['shared_bytes']} B > {ARCHES[result['arch']]} B")
    if result["registers"] > REGISTERS_PER_THREAD:
        errors.append(f"{result['registers']} registers a thread > {REGISTERS_PER_THREAD}")
    if result["registers"] * 32 * result["num_warps"] > REGISTERS_PER_SM:
        errors.append(f"{result['registers']} registers x {32 * result['num_warps']} threads > {REGISTERS_PER_SM}")
    return errors


def run_sharded(full: bool, jobs: int, arches=None) -> list[dict]:
    """compile_all over ``arches`` (default: DEFAULT_ARCHES, all with ``full``) in ``jobs`` processes."""
    arches = arches or (tuple(ARCHES) if full else DEFAULT_ARCHES)
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"{i}.json") for i in range(jobs)]
        argv = [sys.executable, os.path.abspath(__file__), *(["--full"] if full else []),
                "--arch", ",".join(map(str, arches)), "--shards", str(jobs)]
        env = dict(os.environ, TRITON_INTERPRET="0")
        procs = [subprocess.Popen(argv + ["--shard", str(i), "--json", out], env=env) for i, out in enumerate(outs)]
        for proc in procs:
            if proc.wait() != 0:
                raise RuntimeError(f"{' '.join(argv)} exited with {proc.returncode}")
        return [r for out in outs for r in json.load(open(out))]


def table(results: list[dict]) -> str:
    """Markdown: per kernel and arch, the launches compiled and the worst registers / shared / spills."""
    rows = {}
    for r in results:
        row = rows.setdefault((r["kernel"], r["arch"]), {"n": 0, "regs": 0, "shared": 0, "spills": 0, "bad": 0})
        row["n"] += 1
        row["bad"] += bool(limit_errors(r))
        if "error" not in r:
            row["regs"] = max(row["regs"], r["registers"])
            row["shared"] = max(row["shared"], r["shared_bytes"])
            row["spills"] = max(row["spills"], r["spill_bytes"])
    lines = ["| kernel | arch | variants | max registers | max shared (B) | max spills (B) | over a limit |",
             "|---|---|---|---|---|---|---|"]
    for (kernel, arch), row in sorted(rows.items()):
        lines.append(f"| {kernel} | sm_{arch} | {row['n']} | {row['regs']} | {row['shared']} | {row['spills']} | "
                     f"{row['bad']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--arch", default="", help="comma-separated compute capabilities (default: all the matrix's)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--json", help="write this shard's results here (one process) instead of a table")
    parser.add_argument("--shard", type=int, default=0)
    parser.add_argument("--shards", type=int, default=1)
    args = parser.parse_args()
    os.environ["TRITON_INTERPRET"] = "0"  # compiled Triton, not the interpreter (read at Triton's import)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    arches = tuple(int(a) for a in args.arch.split(",") if a) or None
    if args.json:
        results = [r for arch in arches or (tuple(ARCHES) if args.full else DEFAULT_ARCHES)
                   for r in compile_all(arch, args.full, args.shard, args.shards)]
        with open(args.json, "w") as f:
            json.dump(results, f)
        return
    results = run_sharded(args.full, args.jobs, arches)
    print(table(results))
    for r in results:
        for error in limit_errors(r):
            print(f"sm_{r['arch']} {r['kernel']} {r['constexprs']}: {error}")


if __name__ == "__main__":
    main()
