"""The ``lora`` and ``sampling`` parts of benchmarks/gpu_check.py.

lora: the batched LoRA kernel against its torch path (rows of eight adapters and of none in one
batch), timed in GB/s of adapter weights read and TFLOP/s; then the engine serving eight random
adapters and the base in one batch (gpu_check_llm.lora_serving).
sampling: the engine's batched sampler on device logits at batch 64 (greedy, top-k, top-p, min-p,
the three penalties, seeds mixed in one batch): a seeded row draws the same token twice and alone as
in the batch, a penalty moves the token it must, the host syncs of one call are counted
(``torch.cuda.set_sync_debug_mode``), and a call is timed.
"""

import warnings

import torch

from gpu_check_common import DEVICE, DRY, TOLERANCE, against, kernel_module, nominal_peaks, relative_error, time_s

LORA = dict(rows=64, in_features=4096, out_features=14336, slots=8, rank=16)
SAMPLING_BATCH, VOCAB = 64, 49152  # SmolLM2's vocabulary
if DRY:
    LORA = dict(rows=6, in_features=64, out_features=96, slots=2, rank=8)
    SAMPLING_BATCH, VOCAB = 8, 512


def part_lora(report):
    ref_ops, tri_ops = kernel_module("lora_torch"), kernel_module("lora_triton")
    tflops_peak, gbps_peak = nominal_peaks()
    c = LORA
    gen = torch.Generator(device=DEVICE).manual_seed(4)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(c["rows"], c["in_features"], generator=gen, device=DEVICE).to(dtype)
        y = torch.randn(c["rows"], c["out_features"], generator=gen, device=DEVICE).to(dtype)
        a = (torch.randn(c["slots"], c["rank"], c["in_features"], generator=gen, device=DEVICE) / 16).to(dtype)
        b = (torch.randn(c["slots"], c["rank"], c["out_features"], generator=gen, device=DEVICE) / 16).to(dtype)
        # every slot used, and every fourth row on the base alone (-1)
        slot_of_row = torch.arange(c["rows"], device=DEVICE, dtype=torch.int32) % c["slots"]
        slot_of_row[::4] = -1
        scale = torch.rand(c["slots"], generator=gen, device=DEVICE) + 0.5
        # the products alone (on zeros: a bf16 sum with y would round them away), then added to y
        out = tri_ops.lora_apply(torch.zeros_like(y), x, a, b, slot_of_row, scale)
        ref = ref_ops.lora_apply(torch.zeros_like(y, dtype=torch.float32), x.float(), a.float(), b.float(),
                                 slot_of_row, scale)
        err = relative_error(out, ref)
        base_rows_kept = torch.equal(tri_ops.lora_apply(y.clone(), x, a, b, slot_of_row, scale)[::4], y[::4])
        verdict = report.verdict(err <= TOLERANCE[dtype] and base_rows_kept)
        report.line(f"  lora {str(dtype)[6:]:9s} rows={c['rows']} {c['in_features']}->{c['out_features']} "
                    f"slots={c['slots']} r={c['rank']}: err={err:.2e} (tol {TOLERANCE[dtype]:.0e}), base rows "
                    f"{'untouched' if base_rows_kept else 'CHANGED'} {verdict}")
        target = y.clone()
        seconds = time_s(lambda: tri_ops.lora_apply(target, x, a, b, slot_of_row, scale), 20)
        weight_bytes = (a.numel() + b.numel()) * a.element_size()
        used_rows = int((slot_of_row >= 0).sum())
        tflops = 2 * used_rows * c["rank"] * (c["in_features"] + c["out_features"]) / seconds / 1e12
        report.data[f"lora_{str(dtype)[6:]}"] = {"error": err, "us": seconds * 1e6,
                                                 "gbps": weight_bytes / seconds / 1e9, "tflops": tflops}
        report.line(f"    {seconds * 1e6:.1f} us: {against(weight_bytes / seconds / 1e9, gbps_peak, 'GB/s')} of "
                    f"adapter weights, {tflops:.2f} TFLOP/s")
    from gpu_check_llm import lora_serving

    lora_serving(report)


def sampling_rows(batch, vocab, gen):
    """A batch of every kind of row: (params, prompt_ids, output_ids, seed or None)."""
    from gpushare import SamplingParams

    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.8, top_k=50, seed=1),
        dict(temperature=1.0, top_p=0.9, seed=2),
        dict(temperature=0.7, min_p=0.05, seed=3),
        dict(temperature=0.9, top_k=40, top_p=0.95, presence_penalty=0.5, frequency_penalty=0.5, seed=4),
        dict(temperature=1.0, repetition_penalty=1.3, seed=5),
        dict(temperature=1.2),  # unseeded: drawn from the global generator
        dict(temperature=0.0, presence_penalty=2.0),  # greedy with a penalty: not the argmax below
    ]
    rows = []
    for i in range(batch):
        kind = dict(kinds[i % len(kinds)])
        if kind.get("seed") is not None:
            kind["seed"] += 100 * i
        prompt = torch.randint(0, vocab, (16,), generator=gen).tolist()
        output = torch.randint(0, vocab, (8,), generator=gen).tolist()
        rows.append((SamplingParams(**kind), prompt, output, kind.get("seed")))
    return rows


def with_generators(rows):
    """The sampler's rows, each seeded row with a fresh generator on the logits' device."""
    return [(p, prompt, output, None if seed is None else torch.Generator(device=DEVICE).manual_seed(seed))
            for p, prompt, output, seed in rows]


def part_sampling(report):
    from gpushare.engine.sampling import sample_batch

    cpu_gen = torch.Generator().manual_seed(5)
    rows = sampling_rows(SAMPLING_BATCH, VOCAB, cpu_gen)
    logits = torch.randn(SAMPLING_BATCH, VOCAB, generator=cpu_gen).to(DEVICE)
    # the penalised greedy rows: their argmax leads by 1.0 and is in their output, so a presence
    # penalty of 2.0 must move them off it
    penalised = [i for i, (p, *_) in enumerate(rows) if p.greedy and p.presence_penalty]
    for i in penalised:
        top = int(logits[i].argmax())
        logits[i, top] += 1.0
        rows[i][2].append(top)

    def sample(batch_logits, batch_rows):
        return sample_batch(batch_logits.clone(), with_generators(batch_rows))[0]

    first, second = sample(logits, rows), sample(logits, rows)
    seeded = [i for i, (p, *_, seed) in enumerate(rows) if seed is not None or p.greedy]
    repeat_ok = all(first[i] == second[i] for i in seeded)
    report.line(f"  batch {SAMPLING_BATCH}, vocab {VOCAB}: seeded and greedy rows the same on a second call: "
                f"{report.verdict(repeat_ok)}")
    alone = {i: sample(logits[i:i + 1], rows[i:i + 1])[0] for i in seeded[:16]}
    alone_ok = all(alone[i] == first[i] for i in alone)
    report.line(f"  seeded and greedy rows alone as in the batch ({len(alone)} rows): {report.verdict(alone_ok)}")
    greedy = [i for i, (p, *_) in enumerate(rows) if p.greedy and not p.penalised]
    argmax = logits.argmax(dim=-1).tolist()
    greedy_ok = all(first[i] == argmax[i] for i in greedy)
    report.line(f"  greedy rows are the argmax: {report.verdict(greedy_ok)}")
    moved_ok = all(first[i] != rows[i][2][-1] for i in penalised)
    report.line(f"  a presence penalty moves greedy rows off their penalised argmax: {report.verdict(moved_ok)}")
    failures = [t for t in first if not isinstance(t, int)]
    report.line(f"  rows failed: {len(failures)} {report.verdict(not failures)} {failures[:2] if failures else ''}")

    syncs = None
    if DEVICE == "cuda":
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                sample(logits, rows)
            syncs = sum("synchroniz" in str(w.message) for w in caught)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    seconds = time_s(lambda: sample(logits, rows), 5 if not DRY else 1)
    report.data["sampling"] = {"batch": SAMPLING_BATCH, "vocab": VOCAB, "ms": seconds * 1e3, "host_syncs": syncs}
    report.line(f"  one call: {seconds * 1e3:.2f} ms, host syncs "
                f"{syncs if syncs is not None else 'not counted (CPU)'}")
