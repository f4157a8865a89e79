"""The ``kernels`` part of benchmarks/gpu_check.py: the device's own peaks (a large copy, a bf16
matmul), every paged-attention kernel against the torch path run on fp32 copies of the same inputs
(also with a sliding window and soft-capped scores), and each timed: decode in GB/s of K/V read
for a few segment/tile settings, prefill in TFLOP/s, the cache write in GB/s."""

import torch

from gpu_check_common import DEVICE, DRY, TOLERANCE, against, kernel_module, nominal_peaks, relative_error, time_s

# (dtype, block_size, head_dim, num_kv_heads, group): Llama-3-8B-like, SmolLM2-135M, then spread;
# Gemma 2's head dim 256 last.
KERNEL_CASES = [
    (torch.bfloat16, 16, 128, 8, 4),
    (torch.float16, 16, 64, 3, 3),
    (torch.float32, 32, 128, 2, 8),
    (torch.bfloat16, 32, 64, 4, 1),
    (torch.float16, 32, 128, 4, 8),
    (torch.bfloat16, 16, 256, 8, 2),
]
SHORT_CONTEXTS = [1, 17, 63, 130, 200, 255]  # one decode segment: the direct path
LONG_CONTEXTS = [1, 300, 777, 1500, 2049, 3001]  # several segments: the merge path
# (context_len, query_len) per sequence: a whole prompt, a later chunk, a one-token chunk.
PREFILL_SEQS = [(300, 300), (1000, 200), (57, 1), (129, 64)]
DECODE_BENCH = dict(batch=64, context=4096, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
DECODE_SETTINGS = [(256, 64), (128, 32), (128, 64), (512, 64), (256, 32)]  # (SEGMENT_TOKENS, DECODE_TILE_TOKENS)
PREFILL_BENCH = dict(seqs=8, tokens=1024)  # whole prompts, Llama-3-8B's heads
COPY_BYTES = 1 << 30
MATMUL_SIZE = 8192
if DRY:  # the interpreter runs every program in Python: the same checks on tiny inputs
    KERNEL_CASES = [KERNEL_CASES[0], KERNEL_CASES[-1]]
    SHORT_CONTEXTS, LONG_CONTEXTS, PREFILL_SEQS = [1, 17], [1, 300], [(40, 40), (57, 1)]
    DECODE_BENCH = dict(DECODE_BENCH, batch=2, context=300, num_heads=4, num_kv_heads=2, head_dim=64)
    DECODE_SETTINGS, PREFILL_BENCH = DECODE_SETTINGS[:1], dict(seqs=1, tokens=32)
    COPY_BYTES, MATMUL_SIZE = 1 << 20, 128


def paged_inputs(dtype, block_size, head_dim, num_kv_heads, context_lens, gen):
    """Random caches whose blocks are shuffled over the pool; tables padded with 0 as the engine does."""
    owned = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(owned) + 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device=DEVICE).to(dtype)
    v_cache = torch.randn(shape, generator=gen, device=DEVICE).to(dtype)
    order = torch.randperm(num_blocks, generator=gen, device=DEVICE).int()
    block_tables = torch.zeros(len(context_lens), max(owned), dtype=torch.int32, device=DEVICE)
    used = 0
    for i, count in enumerate(owned):
        block_tables[i, :count] = order[used:used + count]
        used += count
    return k_cache, v_cache, block_tables


def part_kernels(report):
    peaks(report)
    correctness(report)
    decode_speed(report)
    prefill_speed(report)


def peaks(report):
    """What this card moves and multiplies, measured: the yardsticks the kernels' figures are set against."""
    tflops_peak, gbps_peak = nominal_peaks()
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    seconds = time_s(lambda: dst.copy_(src), iters=20)
    report.data["copy_gbps"] = 2 * COPY_BYTES / seconds / 1e9
    report.line(f"  copy of {COPY_BYTES / 1e9:.2f} GB: {seconds * 1e3:.3f} ms, "
                f"{against(report.data['copy_gbps'], gbps_peak, 'GB/s')} (read + write bytes)")
    del src, dst
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=DEVICE, dtype=torch.bfloat16)
    seconds = time_s(lambda: a @ a, iters=10)
    report.data["matmul_tflops"] = 2 * MATMUL_SIZE ** 3 / seconds / 1e12
    report.line(f"  bf16 matmul {MATMUL_SIZE}^3: {against(report.data['matmul_tflops'], tflops_peak, 'TFLOP/s')}")
    report.data["nominal_tflops"], report.data["nominal_gbps"] = tflops_peak, gbps_peak


def correctness(report):
    ref_ops, tri_ops = kernel_module("paged_attention_torch"), kernel_module("paged_attention_triton")
    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def reshape_and_cache(case):
        dtype, block_size, head_dim, num_kv_heads, _ = case
        k_cache, v_cache, _ = paged_inputs(dtype, block_size, head_dim, num_kv_heads, [4 * block_size], gen)
        num_tokens = 3 * block_size - 5
        slots = torch.randperm(k_cache.shape[0] * block_size, generator=gen, device=DEVICE)[:num_tokens]
        key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen, device=DEVICE)  # fp32: converted
        value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen, device=DEVICE).to(dtype)
        caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
        tri_ops.reshape_and_cache(key, value, *caches[0], slots)
        ref_ops.reshape_and_cache(key, value, *caches[1], slots)
        return max(relative_error(caches[0][i], caches[1][i]) for i in range(2)), False

    def decode(case, contexts, window=0, softcap=0.0):
        dtype, block_size, head_dim, num_kv_heads, group = case
        k_cache, v_cache, tables = paged_inputs(dtype, block_size, head_dim, num_kv_heads, contexts, gen)
        lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
        q = torch.randn(len(contexts), num_kv_heads * group, head_dim, generator=gen, device=DEVICE).to(dtype)
        out = tri_ops.decode_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5, window, softcap)
        ref = ref_ops.decode_attention(q.float(), k_cache.float(), v_cache.float(), tables, lens, head_dim ** -0.5,
                                       window, softcap)
        return relative_error(out, ref), bool(out.isnan().any())

    def prefill(case, window=0, softcap=0.0):
        dtype, block_size, head_dim, num_kv_heads, group = case
        contexts, q_lens = [c for c, _ in PREFILL_SEQS], [n for _, n in PREFILL_SEQS]
        k_cache, v_cache, tables = paged_inputs(dtype, block_size, head_dim, num_kv_heads, contexts, gen)
        lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
        cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
        q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=gen, device=DEVICE).to(dtype)
        out = tri_ops.prefill_attention(q, k_cache, v_cache, tables, cu, lens, head_dim ** -0.5, window, softcap)
        ref = ref_ops.prefill_attention(q.float(), k_cache.float(), v_cache.float(), tables, cu, lens,
                                        head_dim ** -0.5, window, softcap)
        return relative_error(out, ref), bool(out.isnan().any())

    checked = report.data.setdefault("attention_checks", [])
    for case in KERNEL_CASES:
        dtype, block_size, head_dim, num_kv_heads, group = case
        checks = [
            # bit for bit on a GPU; Triton's interpreter rounds fp32 -> bf16 toward zero, torch to nearest
            ("reshape_and_cache", TOLERANCE[dtype] if DRY else 0.0, lambda: reshape_and_cache(case)),
            ("decode/direct", TOLERANCE[dtype], lambda: decode(case, SHORT_CONTEXTS)),
            ("decode/segments", TOLERANCE[dtype], lambda: decode(case, LONG_CONTEXTS)),
            ("prefill", TOLERANCE[dtype], lambda: prefill(case)),
            # Mistral's sliding window and Gemma 2's soft-capped scores (window 100: mid-segment)
            ("decode/window", TOLERANCE[dtype], lambda: decode(case, LONG_CONTEXTS, 100, 50.0)),
            ("prefill/window", TOLERANCE[dtype], lambda: prefill(case, 100, 50.0)),
        ]
        label = (f"{str(dtype)[6:]:9s} bs={block_size:<3d} D={head_dim:<4d} "
                 f"Hq/Hkv={num_kv_heads * group}/{num_kv_heads:<2d}")
        for kernel, tol, check in checks:
            try:
                err, has_nan = check()
            except Exception as e:  # one broken check must not hide the others
                report.verdict(False)
                report.line(f"  {kernel:17s} {label}: ERROR {type(e).__name__}: {e}")
                checked.append({"kernel": kernel, "case": label, "error": f"{type(e).__name__}: {e}"})
                continue
            verdict = report.verdict(err <= tol and not has_nan)
            report.line(f"  {kernel:17s} {label} err={err:.2e} (tol {tol:.0e}) {'NaN ' if has_nan else ''}{verdict}")
            checked.append({"kernel": kernel, "case": label, "error": err, "ok": verdict == "ok"})


def decode_speed(report):
    ref_ops, tri_ops = kernel_module("paged_attention_torch"), kernel_module("paged_attention_triton")
    _, gbps_peak = nominal_peaks()
    c = DECODE_BENCH
    batch, context, block_size = c["batch"], c["context"], c["block_size"]
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    k_cache, v_cache, tables = paged_inputs(torch.bfloat16, block_size, c["head_dim"], c["num_kv_heads"],
                                            [context] * batch, gen)
    lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    q = torch.randn(batch, c["num_heads"], c["head_dim"], generator=gen, device=DEVICE).to(torch.bfloat16)
    scale = c["head_dim"] ** -0.5
    kv_bytes = 2 * batch * context * c["num_kv_heads"] * c["head_dim"] * 2
    report.line(f"  decode {c}; K/V read per call: {kv_bytes / 1e9:.3f} GB")
    rows = report.data.setdefault("decode_gbps", {})

    def row(label, seconds):
        rows[label] = kv_bytes / seconds / 1e9
        report.line(f"  {label:42s} {seconds * 1e3:8.3f} ms  {against(rows[label], gbps_peak, 'GB/s')}")

    ref = ref_ops.decode_attention(q, k_cache, v_cache, tables, lens, scale)
    defaults = tri_ops.SEGMENT_TOKENS, tri_ops.DECODE_TILE_TOKENS
    try:
        for segment, tile in DECODE_SETTINGS:
            tri_ops.SEGMENT_TOKENS, tri_ops.DECODE_TILE_TOKENS = segment, tile
            err = relative_error(tri_ops.decode_attention(q, k_cache, v_cache, tables, lens, scale), ref)
            seconds = time_s(lambda: tri_ops.decode_attention(q, k_cache, v_cache, tables, lens, scale), 20)
            row(f"triton segment={segment} tile={tile} (err {err:.1e})", seconds)
    finally:
        tri_ops.SEGMENT_TOKENS, tri_ops.DECODE_TILE_TOKENS = defaults
    del ref
    row("torch path", time_s(lambda: ref_ops.decode_attention(q, k_cache, v_cache, tables, lens, scale), 3, 1))

    # the cache write of one decode step of the batch: each token's K and V read once and written once
    key = torch.randn(batch, c["num_kv_heads"], c["head_dim"], generator=gen, device=DEVICE).to(torch.bfloat16)
    slots = torch.randperm(k_cache.shape[0] * block_size, generator=gen, device=DEVICE)[:batch]
    seconds = time_s(lambda: tri_ops.reshape_and_cache(key, key, k_cache, v_cache, slots), 20)
    moved = 4 * key.numel() * key.element_size()
    report.line(f"  reshape_and_cache, {batch} tokens: {seconds * 1e6:.1f} us, {moved / seconds / 1e9:.1f} GB/s "
                "(launch-bound at this size)")


def prefill_speed(report):
    tri_ops = kernel_module("paged_attention_triton")
    tflops_peak, _ = nominal_peaks()
    c, p = DECODE_BENCH, PREFILL_BENCH
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    contexts = [p["tokens"]] * p["seqs"]
    k_cache, v_cache, tables = paged_inputs(torch.bfloat16, c["block_size"], c["head_dim"], c["num_kv_heads"],
                                            contexts, gen)
    lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    cu = torch.arange(0, p["seqs"] + 1, dtype=torch.int32, device=DEVICE) * p["tokens"]
    q = torch.randn(sum(contexts), c["num_heads"], c["head_dim"], generator=gen, device=DEVICE).to(torch.bfloat16)
    seconds = time_s(lambda: tri_ops.prefill_attention(q, k_cache, v_cache, tables, cu, lens, c["head_dim"] ** -0.5),
                     10)
    # causal: query i sees i + 1 keys; QK^T and PV are 2 FLOPs per (query, key, dim) each
    pairs = p["seqs"] * p["tokens"] * (p["tokens"] + 1) // 2
    tflops = 4 * pairs * c["num_heads"] * c["head_dim"] / seconds / 1e12
    report.data["prefill_tflops"] = tflops
    report.line(f"  prefill {p['seqs']} x {p['tokens']} tokens, Hq/Hkv={c['num_heads']}/{c['num_kv_heads']} D="
                f"{c['head_dim']}: {seconds * 1e3:.3f} ms, {against(tflops, tflops_peak, 'TFLOP/s')}")
