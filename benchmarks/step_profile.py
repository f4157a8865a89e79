"""Where a decode step's time goes: ms per step at batch 1 and 16, and torch's profile of the ops.

    .venv/bin/python benchmarks/step_profile.py                       # auto weights, batch 1 and 16
    .venv/bin/python benchmarks/step_profile.py --weights float32 int8 int4 --batch 1 16 64

For each weight format: the offline LLM runs `batch` greedy streams of `--tokens` tokens after a
short prompt; the figure is the median wall time of the decode steps (the engine's on_step hook
times them), on the fused decode path (models/fused_decode.py) where the model takes it and then
layer by layer. Then, the engine shut down, the model alone runs decode steps of the same batches on
this thread over `--context` cached tokens each under torch's profiler (which records the ops of
the thread that started it, so not an engine thread's): the ops listed by self CPU time, lm_head
included, layer by layer. Run it with nothing else on the machine.
"""

import argparse
import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from perplexity import find_gguf  # noqa: E402

from gpushare import LLM, SamplingParams  # noqa: E402
from gpushare.models.llama import AttentionBatch  # noqa: E402


def decode_step_ms(llm: LLM, batch: int, tokens: int) -> float:
    """Median wall time of the engine's steps once every stream is decoding."""
    stamps = []
    llm.engine.on_step = lambda *_: stamps.append(time.perf_counter())
    prompts = [[{"role": "user", "content": f"Tell me a story about the number {i}."}] for i in range(batch)]
    llm.chat(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    llm.engine.on_step = None
    gaps = [b - a for a, b in zip(stamps, stamps[1:])][2:]  # the first steps prefill
    return statistics.median(gaps) * 1e3


def model_decode_step(model, batch: int, context: int, block_size: int = 16):
    """A function running one decode step of ``batch`` sequences over ``context`` cached tokens each
    (random K/V in a cache of their own), lm_head included."""
    config = model.config
    width = context // block_size + 1
    shape = (batch * width, block_size, config.num_kv_heads, config.head_dim)
    caches = [(torch.randn(shape), torch.randn(shape)) for _ in range(config.num_layers)]
    tables = torch.arange(batch * width, dtype=torch.int32).view(batch, width)
    slots = tables[:, (context - 1) // block_size].long() * block_size + (context - 1) % block_size
    none = torch.zeros(0, dtype=torch.int32)
    layout = AttentionBatch(slots, 0, torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), none,
                            tables, torch.full((batch,), context, dtype=torch.int32))
    ids, positions = torch.randint(0, 1000, (batch,)), torch.full((batch,), context - 1)
    return lambda: model.logits(model(ids, positions, caches, layout))


def profiled(model, batch: int, args) -> str:
    step = model_decode_step(model, batch, args.context)
    for _ in range(3):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", nargs="+", default=["auto"])
    p.add_argument("--batch", nargs="+", type=int, default=[1, 16])
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--context", type=int, default=200, help="cached tokens per sequence in the profiled steps")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--top", type=int, default=12, help="ops listed per profile")
    args = p.parse_args()
    model = find_gguf()
    for weights in args.weights:
        llm = LLM(model, weights=weights, num_threads=args.threads)
        try:
            for batch in args.batch:
                for fused in (True, False):
                    llm.model.model.fused_decode = fused
                    decode_step_ms(llm, batch, 8)  # warm-up
                    ms = decode_step_ms(llm, batch, args.tokens)
                    path = "fused" if fused and llm.model.model._decode_weights else "layer by layer"
                    print(f"{weights} ({llm.model.weights}) batch {batch}, {path}: {ms:.2f} ms per decode step, "
                          f"{batch / ms * 1e3:.0f} tok/s", flush=True)
                    if path == "layer by layer":
                        break
        finally:
            llm.shutdown()  # its engine thread ends, and its OpenMP team: this thread's alone is timed below
        torch.set_num_threads(args.threads)
        llm.model.model.fused_decode = False  # op by op: the fused call hides its kernels from the profiler
        for batch in args.batch:
            print(f"{weights}: the model alone, 10 steps of batch {batch} at {args.context} tokens of context:")
            print(profiled(llm.model.model, batch, args), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
