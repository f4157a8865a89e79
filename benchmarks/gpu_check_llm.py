"""The ``llm_*`` parts of benchmarks/gpu_check.py: the offline ``LLM`` (gpushare/llm.py) on the
device, on random-weight models of real layer shapes (gpu_check_models.py).

llm_bfloat16, llm_int8, llm_int4: SmolLM2-135M with those weights at concurrency 1, 16 and 64 (greedy,
fixed length): tokens/s, peak device memory, Triton kernels compiled at warm-up and (the ones that should
be none) during the timed runs, one profiled step's top kernels (int4), and whether a seeded, penalised
request draws the same tokens alone as among 63 others.
llm_big: two layers of Llama-3-8B and of Gemma-2-9B (head dim 256, soft caps, a sliding window) in
bfloat16 (Llama also int4) at concurrency 16.
"""

import os
import tempfile
import time

import torch

from gpu_check_common import DEVICE, DRY, triton_compiled_count
from gpu_check_models import write_adapter, write_model

CONCURRENCY = [1, 16, 64]
GEN_TOKENS = 128 if not DRY else 4
BIG = [("llama-3-8b-2layers", "bfloat16"), ("llama-3-8b-2layers", "int4"), ("gemma-2-9b-2layers", "bfloat16")]
BIG_CONCURRENCY = 16
DTYPE = "bfloat16" if not DRY else "float32"  # activations (the CPU's exact path in the dry run)


def prompts(count):
    topics = ["a lighthouse", "the tides", "a violin", "bread", "a comet", "glaciers", "a chess game", "bees"]
    return [f"Write a short story about {topics[i % len(topics)]}, part {i}." for i in range(count)]


def peak_memory_gib():
    return torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else None


def load(report, folder, weights):
    from gpushare import LLM

    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start, compiled_before = time.perf_counter(), triton_compiled_count()
    llm = LLM(model=folder, dtype=DTYPE, device=DEVICE, weights=weights, max_num_seqs=64)
    compiled = _diff(triton_compiled_count(), compiled_before)  # kernels built at load (none, or every bucket)
    report.data.setdefault("llm", {})[f"{os.path.basename(folder)}/{weights}"] = {"compiled_at_load": compiled}
    report.line(f"  {os.path.basename(folder)} {weights}: loaded in {time.perf_counter() - start:.1f} s "
                f"({llm.model.kernel} kernels; Triton kernels compiled at load: {compiled})")
    return llm


def run_model(report, llm, key, concurrency_list, profile=False):
    from gpushare import SamplingParams

    params = SamplingParams(max_tokens=GEN_TOKENS, temperature=0.0, ignore_eos=True)
    compiled_before = triton_compiled_count()
    start = time.perf_counter()
    for concurrency in sorted(set(concurrency_list)):  # every batch shape once, before the clock runs
        llm.generate(prompts(concurrency), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    warmup_s = time.perf_counter() - start
    compiled_warm = triton_compiled_count()
    rows = report.data.setdefault("llm", {}).setdefault(key, {})
    for concurrency in concurrency_list:
        start = time.perf_counter()
        outs = llm.generate(prompts(concurrency), params)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.token_ids) for o in outs)
        rows[f"c{concurrency}_tok_s"] = tokens / seconds
        report.line(f"    concurrency {concurrency:3d}: {tokens:6d} tokens in {seconds:6.2f} s = "
                    f"{tokens / seconds:8.0f} tok/s")
    compiled_after = triton_compiled_count()
    rows.update(warmup_s=warmup_s, peak_gib=peak_memory_gib(), compiled_at_warmup=_diff(compiled_warm, compiled_before),
                compiled_while_timed=_diff(compiled_after, compiled_warm))
    report.line(f"    warm-up {warmup_s:.1f} s; Triton kernels compiled: {rows['compiled_at_warmup']} at warm-up, "
                f"{rows['compiled_while_timed']} while timed (each one a stall mid-serving); peak device memory "
                f"{'%.2f GiB' % rows['peak_gib'] if rows['peak_gib'] is not None else 'n/a (CPU)'}")
    if profile:
        profiled_step(report, llm)


def _diff(after, before):
    return None if after is None or before is None else after - before


def profiled_step(report, llm):
    """A few decode steps of a 16-sequence batch under torch's profiler: where a step's time goes."""
    from torch.profiler import ProfilerActivity, profile

    from gpushare import SamplingParams

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    try:  # the step runs on the engine's thread, which a default profile does not see (torch >= 2.6 has this)
        config = {"experimental_config": torch._C._profiler._ExperimentalConfig(profile_all_threads=True)}
    except (AttributeError, TypeError):
        config = {}
    with profile(activities=activities, **config) as prof:
        llm.generate(prompts(16), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    sort = "cuda_time_total" if DEVICE == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=12, max_name_column_width=60)
    report.line("    profile of 16 sequences x 4 tokens (prefill + 3 decode steps):")
    for text in table.splitlines():
        report.line("      " + text)


def seeded_batch_invariance(report, llm, key):
    """A seeded, penalised request alone and as one of 64: the same tokens? (Reported, not failed:
    bf16 matmuls may round differently for other batch sizes, which can change a sampled token.)"""
    from gpushare import SamplingParams

    params = [SamplingParams(max_tokens=GEN_TOKENS // 2 or 1, temperature=0.8, top_p=0.95, seed=1000 + i,
                             presence_penalty=0.5, frequency_penalty=0.3, ignore_eos=True) for i in range(64)]
    batch = llm.generate(prompts(64), params)
    alone = llm.generate(prompts(64)[:1], params[:1])
    again = llm.generate(prompts(64)[:1], params[:1])
    repeat_ok = alone[0].token_ids == again[0].token_ids
    same = alone[0].token_ids == batch[0].token_ids
    report.data["llm"][key]["seeded_alone_equals_batch"] = same
    report.line(f"    seeded + penalised request: the same tokens twice alone "
                f"{report.verdict(repeat_ok)}; alone as in a batch of 64: {'same' if same else 'DIFFERENT'}")


def part_llm(report, weights):
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        start = time.perf_counter()
        folder = write_model("smollm2-135m", os.path.join(tmp, "smollm2-135m"), DRY, DEVICE)
        report.line(f"  wrote a random SmolLM2-135M{' (dry: tiny)' if DRY else ''} in "
                    f"{time.perf_counter() - start:.1f} s")
        llm = load(report, folder, weights)
        try:
            run_model(report, llm, f"smollm2-135m/{weights}", CONCURRENCY, profile=weights == "int4")
            seeded_batch_invariance(report, llm, f"smollm2-135m/{weights}")
        finally:
            llm.shutdown()


def lora_serving(report, adapters=8, concurrency=16):
    """The engine with LoRA: SmolLM2-135M (bf16) and ``adapters`` random adapters, ``concurrency``
    greedy requests of which every fourth is on the base alone: those must give the base's tokens
    (the adapters' rows add nothing to theirs); the others are timed beside the base alone."""
    from gpushare import SamplingParams

    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        folder = write_model("smollm2-135m", os.path.join(tmp, "smollm2-135m"), DRY, DEVICE)
        llm = load(report, folder, "bfloat16")
        try:
            for i in range(adapters):
                llm.load_adapter(f"a{i}", write_adapter("smollm2-135m", os.path.join(tmp, f"a{i}"), DRY, seed=i))
            names = [None if i % 4 == 0 else f"a{i % adapters}" for i in range(concurrency)]
            params = SamplingParams(max_tokens=GEN_TOKENS, temperature=0.0, ignore_eos=True)
            llm.generate(prompts(concurrency), params, adapter=names)  # warm-up
            timed = {}
            for label, adapter in (("base alone", None), (f"{adapters} adapters", names)):
                start = time.perf_counter()
                outs = llm.generate(prompts(concurrency), params, adapter=adapter)
                timed[label] = (outs, time.perf_counter() - start)
            base, _ = timed["base alone"]
            mixed, _ = timed[f"{adapters} adapters"]
            base_rows_ok = all(mixed[i].token_ids == base[i].token_ids for i, n in enumerate(names) if n is None)
            changed = sum(mixed[i].token_ids != base[i].token_ids for i, n in enumerate(names) if n is not None)
            for label, (outs, seconds) in timed.items():
                tokens = sum(len(o.token_ids) for o in outs)
                report.data.setdefault("lora_serving", {})[label] = tokens / seconds
                report.line(f"  engine, concurrency {concurrency}, {label}: {tokens / seconds:.0f} tok/s")
            report.line(f"  base rows beside adapter rows give the base's tokens: {report.verdict(base_rows_ok)}; "
                        f"adapter rows that differ from the base: {changed} of {len(names) - names.count(None)}")
        finally:
            llm.shutdown()


# one part per weight format: each under its own timeout, so a hang in one keeps the others' figures
def part_llm_bfloat16(report):
    part_llm(report, "bfloat16")


def part_llm_int8(report):
    part_llm(report, "int8")


def part_llm_int4(report):
    part_llm(report, "int4")


def part_llm_big(report):
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        folders = {}
        for name, weights in BIG:
            if name not in folders:
                start = time.perf_counter()
                folders[name] = write_model(name, os.path.join(tmp, name), DRY, DEVICE)
                report.line(f"  wrote a random {name}{' (dry: tiny)' if DRY else ''} in "
                            f"{time.perf_counter() - start:.1f} s")
            llm = load(report, folders[name], weights)
            try:
                run_model(report, llm, f"{name}/{weights}", [BIG_CONCURRENCY])
            finally:
                llm.shutdown()
                del llm
