"""Every C++ CPU kernel on fixed inputs, for test_cpu_isa: run as a script in a process of its own
(one build of torch.ops.gpushare a process) with ``GPUSHARE_CPU_ISA`` set, it saves each case's output
by name, at 1 and 2 threads, so that the builds' outputs can be compared bit for bit.

    GPUSHARE_CPU_ISA=avx2 python tests/isa_battery.py OUT.pt

The cases: the block kernel (int8 and int4 weights, float16 and float32 group scales, 1 to 17 rows,
the SIMD kernel and the in-build portable one); decode and prefill attention over float32, bfloat16
and int8 caches, head dims 24, 48, 64, 80 and 128, GQA groups 1, 3 and 8, windows and soft caps;
RMSNorm with and without the residual; RoPE with the cache write; batched LoRA (tests/lora_cases.py);
and the fused decode of two layers.
Inputs are random but seeded, and every cache row holds data (no NaN): equal outputs are equal bits.
"""

import functools
import sys

import torch

import lora_cases
from gpushare import kernels
from gpushare.kernels import cpu_ops, cpu_qmatmul
from gpushare.kernels.paged_attention_torch import Int8KV
from gpushare.models.quantized import quantize_int4, quantize_int8

THREADS = (1, 2)


def quantized(n: int, k: int, bits: int, gen: torch.Generator, half_groups: bool = True) -> tuple:
    """A random weight packed for the block kernel: (codes, scales, mins or None, n)."""
    weight = torch.randn(n, k, generator=gen) / 30
    if bits == 8:
        w = quantize_int8(weight)
        return cpu_qmatmul.pack_int8(w.qweight), w.scales, None, n
    w = quantize_int4(weight)
    scales, mins = (w.scales.half().float(), w.mins.half().float()) if half_groups else (w.scales, w.mins)
    return (*cpu_qmatmul.pack_int4(w.nibbles(), scales, mins), n)


def activations(rows: int, k: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, k, generator=gen)
    x[:, 3] *= 2000  # an outlier channel
    x[0, 32:64] = 0  # an all-zero block
    return x


def matmul_cases(gen: torch.Generator):
    for n, k in [(48, 64), (80, 576), (960, 576)]:
        for bits, half in [(8, True), (4, True), (4, False)]:
            weight = quantized(n, k, bits, gen, half)
            for rows in (1, 2, 3, 4, 5, 9, 17):
                x = activations(rows, k, gen)
                name = f"matmul n{n} k{k} int{bits}{' f16' if half else ' f32'} rows{rows}"
                yield name, lambda x=x, w=weight: cpu_qmatmul.matmul(x, *w)
                yield name + " in-build-portable", lambda x=x, w=weight: cpu_qmatmul.matmul(x, *w, portable=True)


def paged(gen: torch.Generator, kind: str, block_size: int, kv_heads: int, dim: int, lengths: list[int]):
    """K and V caches of random rows in shuffled blocks (as the kernels take them) and the block tables."""
    width = max(lengths) // block_size + 1
    blocks = len(lengths) * width
    shape = (blocks, block_size, kv_heads, dim)
    tables = torch.randperm(blocks, generator=gen).to(torch.int32).view(len(lengths), width)

    def cache():
        if kind == "int8":
            return torch.randint(-127, 128, shape, dtype=torch.int8, generator=gen), torch.rand(shape[:3], generator=gen) / 50
        return torch.randn(shape, generator=gen).to(getattr(torch, kind)), None

    return cache(), cache(), tables


def attention_cases(gen: torch.Generator):
    lengths = [1, 7, 16, 19, 64, 150, 300]
    for kind in ("float32", "bfloat16", "int8"):
        for dim, block_size in [(24, 16), (48, 16), (64, 16), (80, 16), (96, 16), (128, 32)]:
            for group in (1, 3, 8):
                (k, k_scale), (v, v_scale), tables = paged(gen, kind, block_size, 2, dim, lengths)
                q = torch.randn(len(lengths), 2 * group, dim, generator=gen)
                lens = torch.tensor(lengths, dtype=torch.int32)
                for window, softcap in [(0, 0.0), (21, 0.0), (0, 5.0)]:
                    name = f"decode {kind} d{dim} bs{block_size} gqa{group} window{window} softcap{softcap}"
                    yield name, lambda q=q, k=k, v=v, ks=k_scale, vs=v_scale, t=tables, n=lens, w=window, s=softcap: (
                        torch.ops.gpushare.decode_attention(q, k, v, ks, vs, t, n, 0.125, w, s))
            # a prompt chunk of 40 rows after a cached prefix of 110 and a fresh prompt of 30, in one call
            (k, k_scale), (v, v_scale), tables = paged(gen, kind, block_size, 2, dim, [150, 30])
            caches = [Int8KV(c, s) if s is not None else c for c, s in ((k, k_scale), (v, v_scale))]
            q = torch.randn(70, 6, dim, generator=gen)
            cu, lens = torch.tensor([0, 40, 70], dtype=torch.int32), torch.tensor([150, 30], dtype=torch.int32)
            for window, softcap in [(0, 0.0), (21, 0.0), (0, 5.0)]:
                yield f"prefill {kind} d{dim} window{window} softcap{softcap}", (
                    lambda q=q, c=caches, t=tables, w=window, s=softcap, n=lens:
                    kernels.prefill_attention(q, c[0], c[1], t, cu, n, 0.125, w, s))


def norm_and_rope_cases(gen: torch.Generator):
    for hidden in (576, 100):
        x, residual, weight = (torch.randn(*shape, generator=gen) for shape in ((37, hidden), (37, hidden), (hidden,)))
        yield f"rms_norm h{hidden}", lambda x=x, w=weight: torch.ops.gpushare.rms_norm(x, None, w, 1e-5)[0]
        yield f"rms_norm h{hidden} residual", lambda x=x, r=residual, w=weight: torch.stack(
            torch.ops.gpushare.rms_norm(x, r, w, 1e-5))
    for kind in ("float32", "bfloat16", "int8"):
        for dim in (48, 64, 128):
            q_heads, kv_heads, tokens, blocks, block_size = 6, 2, 21, 4, 16
            qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim, generator=gen)
            trig = torch.randn(tokens, 2, 1, dim, generator=gen)
            slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
            yield f"rope {kind} d{dim}", lambda qkv=qkv, trig=trig, slots=slots, kind=kind, dim=dim: rope(
                qkv.clone(), trig, slots, kind, (blocks, block_size, kv_heads, dim), q_heads, kv_heads)


def rope(qkv, trig, slots, kind, shape, q_heads, kv_heads) -> torch.Tensor:
    """qkv after RoPE, and both caches after the write, flattened into one float64 row."""
    if kind == "int8":
        caches = [(torch.zeros(shape, dtype=torch.int8), torch.zeros(shape[:-1])) for _ in "kv"]
    else:
        caches = [(torch.zeros(shape, dtype=getattr(torch, kind)), None) for _ in "kv"]
    (k, ks), (v, vs) = caches
    torch.ops.gpushare.rope_and_cache(qkv, trig[:, 0], trig[:, 1], q_heads, kv_heads, k, v, ks, vs, slots)
    parts = [qkv, k, v] + ([ks, vs] if kind == "int8" else [])
    return torch.cat([p.double().flatten() for p in parts])


def lora_apply_cases():
    for case in lora_cases.cases():
        yield case.name, lambda case=case: case.run(torch.ops.gpushare.lora_apply)


def decode_adapters(hidden: int, q_width: int, kv_width: int, mlp: int, gen: torch.Generator) -> tuple:
    """decode_layers' LoRA arguments for two layers: three rank-8 slots of q, k, v, o, gate, up and down
    (bfloat16, as on a quantized base), and the slots of three rows (one of the base)."""
    shapes = [(q_width, hidden), (kv_width, hidden), (kv_width, hidden), (hidden, q_width), (mlp, hidden),
              (mlp, hidden), (hidden, mlp)]
    a_stacks = [(torch.randn(3, 8, k, generator=gen) / 10).bfloat16() for _ in range(2) for _, k in shapes]
    b_stacks = [(torch.randn(3, 8, n, generator=gen) / 10).bfloat16() for _ in range(2) for n, _ in shapes]
    return a_stacks, b_stacks, torch.tensor([2, -1, 0], dtype=torch.int32), torch.tensor([2.0, 0.5, 1.0])


def decode_layers_cases(gen: torch.Generator):
    """Two layers (int8, then int4 weights) of hidden 192, 3 query heads and 1 KV head of 64, MLP 256."""
    hidden, q_heads, kv_heads, dim, mlp = 192, 3, 1, 64, 256
    shapes = [((q_heads + 2 * kv_heads) * dim, hidden), (hidden, q_heads * dim), (2 * mlp, hidden), (hidden, mlp)]
    linears = [quantized(n, k, bits, gen) for bits in (8, 4) for n, k in shapes]
    norms = [1 + torch.randn(hidden, generator=gen) / 10 for _ in range(4)]
    adapters = decode_adapters(hidden, q_heads * dim, kv_heads * dim, mlp, gen)
    for kind in ("float32", "bfloat16", "int8"):
        lengths = [5, 40, 150]
        caches = [paged(gen, kind, 16, kv_heads, dim, lengths) for _ in range(2)]
        tables = caches[0][2]
        lens = torch.tensor(lengths, dtype=torch.int32)
        positions = lens.long() - 1
        slots = tables[torch.arange(3), positions // 16].long() * 16 + positions % 16
        trig = torch.randn(3, 2, 1, dim, generator=gen)
        x = torch.randn(3, hidden, generator=gen)
        for softcap in (0.0, 5.0):
            def run(lora, pause=None, caches=caches, trig=trig, x=x, slots=slots, tables=tables, softcap=softcap):
                fresh = [tuple(None if c is None else c.clone() for c in pair) for k, v, _ in caches for pair in (k, v)]
                k_caches, v_caches = [fresh[0][0], fresh[2][0]], [fresh[1][0], fresh[3][0]]
                k_scales, v_scales = [fresh[0][1], fresh[2][1]], [fresh[1][1], fresh[3][1]]
                got = torch.ops.gpushare.decode_layers(
                    x, norms, [w[0] for w in linears], [w[1] for w in linears], [w[2] for w in linears],
                    [w[3] for w in linears], k_caches, v_caches, k_scales, v_scales, trig[:, 0], trig[:, 1], slots,
                    tables, lens, q_heads, kv_heads, 1e-5, 0.125, [0, 21], softcap, *lora, pause)
                expected_layers = 2 if pause is None else 1  # a set flag stops the call after its first layer
                assert got[1] == expected_layers, got[1]
                return got[0]
            for lora_name, lora in [("", ([], [], None, None)), (" lora", adapters)]:
                yield f"decode_layers {kind} softcap{softcap}{lora_name}", functools.partial(run, lora)
                yield (f"decode_layers {kind} softcap{softcap}{lora_name} paused",
                       functools.partial(run, lora, torch.ones(1, dtype=torch.uint8)))


def main(path: str) -> int:
    assert cpu_ops.loaded(), "the C++ kernels did not build"
    outputs = {"isa": cpu_ops.isa(), "block_kernel": torch.ops.gpushare.quantized_matmul_kernel(), "cases": {}}
    gen = torch.Generator().manual_seed(0)
    cases = [*matmul_cases(gen), *attention_cases(gen), *norm_and_rope_cases(gen), *lora_apply_cases(),
             *decode_layers_cases(gen)]
    with torch.inference_mode():
        for threads in THREADS:
            torch.set_num_threads(threads)
            for name, run in cases:
                outputs["cases"][f"{name} threads{threads}"] = run()
    torch.save(outputs, path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
