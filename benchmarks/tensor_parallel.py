"""Tensor parallelism on two CPU devices: what TP=2 over cpu:0 and cpu:1 serves against TP=1 on
cpu:0 alone, and what its communication costs.

1. serving: `gpushare serve` with engine.devices [cpu:0, cpu:1] and the model at
   tensor_parallel 2, against engine.devices [cpu:0] with the model there; benchmarks/serve.py's
   streaming load (greedy, ignore_eos, seeded) at concurrency 1 (single stream) and 16. The
   daemon, its HTTP and the load generator share the two cores in both runs.
2. communication: two processes pinned one per core, joined by gloo as the ranks are: one
   all-reduce of a step's [tokens, hidden] float32 block output, times 2 per layer (what a
   step spends in all-reduces, and gloo's own all_reduce beside it); the broadcast of one
   step's inputs; and lm_head whole on one rank against vocab-parallel (each rank half, then
   the gather of the logits: what gpushare does).

3. --synthetic: the serving comparison on a random-weight Llama of 0.5B parameters (hidden 2048,
   8 layers, 16 heads, 8 KV heads, SmolLM2's tokenizer), built in a temporary folder: a model
   whose steps are mostly matrix work, where SmolLM2-135M's are mostly per-op overhead that
   every rank pays whole.

    python benchmarks/tensor_parallel.py                 # SmolLM2: both parts, ~2 minutes on a 2-core CPU
    python benchmarks/tensor_parallel.py --only serving --synthetic --weights int8   # ~5 minutes
    python benchmarks/tensor_parallel.py --only communication

Run nothing else meanwhile: two torch processes on 2 cores slow each other 5-20x.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tenants import parse_with_model  # noqa: E402
from workers import measure  # noqa: E402

HIDDEN, VOCAB, LAYERS = 576, 49152, 30  # SmolLM2-135M
SYNTHETIC = {"hidden": 2048, "inter": 5632, "layers": 8, "heads": 16, "kv_heads": 8}


async def serving(args) -> dict:
    model = {"name": "bench", "weights": args.weights}
    result = {}
    for concurrency in (1, 16):
        result[concurrency] = {
            "tp1": await measure(args, {"devices": ["cpu:0"]}, [{**model, "device": "cpu:0"}], concurrency),
            "tp2": await measure(args, {"devices": ["cpu:0", "cpu:1"]}, [{**model, "tensor_parallel": 2}],
                                 concurrency)}
    return result


def _timed_ms(fn, reps: int) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def _rank(rank: int, init_file: str, reps: int, out_file: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from gpushare.engine.tp_runtime import Forward, all_reduce, broadcast_op, gather_logits, join_group
    from gpushare.protocol.messages import GroupSpec
    from gpushare.models.llama import AttentionBatch

    torch.set_num_threads(1)
    join_group(GroupSpec(rank, 2, init_file, ["cpu:0", "cpu:1"]), "cpu")
    os.sched_setaffinity(0, [rank])  # this thread, as a rank's engine thread; gloo's own threads are not pinned
    figures = {}
    for tokens in (1, 16):
        x = torch.randn(tokens, HIDDEN)
        for _ in range(20):
            all_reduce(x)
        figures[f"all_reduce_step_ms_{tokens}"] = _timed_ms(lambda: all_reduce(x), reps) * 2 * LAYERS
        figures[f"gloo_all_reduce_step_ms_{tokens}"] = _timed_ms(lambda: dist.all_reduce(x), reps // 10) * 2 * LAYERS
        step = Forward("bench", torch.arange(tokens), torch.arange(tokens), AttentionBatch(
            torch.arange(tokens), 0, torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
            torch.zeros(0, dtype=torch.int32), torch.zeros(tokens, 8, dtype=torch.int32),
            torch.full((tokens,), 100, dtype=torch.int32)))
        figures[f"broadcast_ms_{tokens}"] = _timed_ms(lambda: broadcast_op(step if rank == 0 else None), reps // 10)
        weight = torch.randn(VOCAB, HIDDEN).to(torch.bfloat16)
        h = torch.randn(tokens, HIDDEN).to(torch.bfloat16)
        for name, rows in (("lm_head_whole_ms", VOCAB), ("lm_head_half_ms", VOCAB // 2)):
            w = weight[:rows].contiguous()
            F.linear(h, w)
            figures[f"{name}_{tokens}"] = _timed_ms(lambda: F.linear(h, w), reps // 10)
        part = torch.randn(tokens, VOCAB // 2)
        figures[f"gather_logits_ms_{tokens}"] = _timed_ms(lambda: gather_logits(part, [VOCAB // 2] * 2), reps // 10)
    if rank == 0:
        Path(out_file).write_text(json.dumps(figures))
    dist.destroy_process_group()


def communication(reps: int) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "figures.json")
        mp.spawn(_rank, args=(os.path.join(tmp, "rendezvous"), reps, out), nprocs=2)
        return json.loads(Path(out).read_text())


def report(result: dict, args) -> str:
    lines = []
    if "serving" in result:
        model = "a random 0.5B Llama" if args.synthetic else os.path.basename(args.model_path)
        lines.append(f"serving {model}, {args.weights} weights, {args.output_len} tokens per request (output tok/s):")
        for concurrency, r in result["serving"].items():
            lines.append(f"  concurrency {concurrency:>2}: TP=1 on cpu:0 {r['tp1']:.1f}, TP=2 over cpu:0+cpu:1 "
                         f"{r['tp2']:.1f} ({r['tp2'] / r['tp1']:.2f}x)")
    if "communication" in result:
        c = result["communication"]
        lines.append("communication between the two ranks (one core each), ms:")
        for tokens in (1, 16):
            lines.append(
                f"  {tokens:>2} tokens a step: all-reduces {c[f'all_reduce_step_ms_{tokens}']:.2f} per step "
                f"({2 * LAYERS} of [{tokens}, {HIDDEN}]; gloo's own all_reduce "
                f"{c[f'gloo_all_reduce_step_ms_{tokens}']:.2f}), the step's broadcast {c[f'broadcast_ms_{tokens}']:.3f}; "
                f"bfloat16 lm_head whole {c[f'lm_head_whole_ms_{tokens}']:.2f} vs half {c[f'lm_head_half_ms_{tokens}']:.2f} "
                f"+ gather {c[f'gather_logits_ms_{tokens}']:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="GGUF file or HF folder (default: the bundled SmolLM2-135M)")
    p.add_argument("--only", choices=["serving", "communication"])
    p.add_argument("--weights", default="auto", help="the model's weight format (default: auto)")
    p.add_argument("--synthetic", action="store_true",
                   help="serve a random-weight 0.5B Llama instead (its tokenizer from --model-path)")
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--reps", type=int, default=2000, help="all-reduces timed (broadcasts and lm_heads: a tenth)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-budget", default="1GiB")
    p.add_argument("--json-out")
    args = parse_with_model(p, argv)
    result = {}
    folder = tempfile.mkdtemp(prefix="gpushare-tp-model-") if args.synthetic else None
    try:
        if folder is not None:
            sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
            from model_files import random_llama_folder

            args.model_path = random_llama_folder(args.model_path, folder, **SYNTHETIC)
        if args.only in (None, "communication"):
            result["communication"] = communication(args.reps)
        if args.only in (None, "serving"):
            result["serving"] = asyncio.run(serving(args))
    finally:
        if folder is not None:
            shutil.rmtree(folder)
    print(report(result, args))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"config": vars(args), **result}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
