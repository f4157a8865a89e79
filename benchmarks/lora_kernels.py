"""Batched LoRA alone, torch path against the C++ kernel: us per model step's LoRA at 1, 16 and 64 rows.

    .venv/bin/python benchmarks/lora_kernels.py
    .venv/bin/python benchmarks/lora_kernels.py --rows 1 --threads 1 --reps 50

One step's LoRA of one SmolLM2-135M layer's targets (q 576, k 192, v 192 and o 576 wide on hidden
576; gate and up 1536 wide on 576; down 576 wide on 1536), 16 slots of rank 16, each row's slot
drawn at random; q, k and v go into column slices of one fused qkv output, gate and up into one
gate_up output, as the model's linears pass them. Each figure is the best of ``--reps`` passes
(models/cpu_kernels.best_time_s). Run it with nothing else running.
"""

import argparse
import sys

import torch

from gpushare.kernels import cpu_ops, lora_torch
from gpushare.models.cpu_kernels import best_time_s

HIDDEN, INTERMEDIATE = 576, 1536
# fused output -> its targets' (out, in) widths, in column order
LINEARS = {"qkv": [(576, HIDDEN), (192, HIDDEN), (192, HIDDEN)], "o": [(HIDDEN, HIDDEN)],
           "gate_up": [(INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN)], "down": [(HIDDEN, INTERMEDIATE)]}


def torch_path(y, x, a_stack, b_stack, slot_of_row, scale_of_slot):
    """The torch path as the dispatch runs it on a column slice: through a copy."""
    y.copy_(lora_torch.lora_apply(y.contiguous(), x, a_stack, b_stack, slot_of_row, scale_of_slot))


def layer_lora(rows: int, slots: int, rank: int, gen: torch.Generator):
    """A function that runs ``lora_apply`` (given) on every target of one layer."""
    work = []
    for parts in LINEARS.values():
        y = torch.randn(rows, sum(out for out, _ in parts), generator=gen)
        x = torch.randn(rows, parts[0][1], generator=gen)
        start = 0
        for out, inp in parts:
            a_stack = torch.randn(slots, rank, inp, generator=gen) / 10
            b_stack = torch.randn(slots, out, rank, generator=gen) / 10
            work.append((y.narrow(1, start, out), x, a_stack, b_stack))
            start += out
    slot_of_row = torch.randint(0, slots, (rows,), generator=gen, dtype=torch.int32)
    scale_of_slot = torch.full((slots,), 2.0)

    def run(lora_apply):
        for y, x, a_stack, b_stack in work:
            lora_apply(y, x, a_stack, b_stack, slot_of_row, scale_of_slot)

    return run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", type=int, default=[1, 16, 64])
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    paths = {"torch": torch_path}
    if cpu_ops.loaded():
        paths[f"C++ ({cpu_ops.isa()})"] = torch.ops.gpushare.lora_apply
    print(f"us per layer's LoRA (7 targets), {args.slots} slots of rank {args.rank}, best of {args.reps}, "
          f"{args.threads} threads")
    print(f"{'path':16}" + "".join(f"{'rows ' + str(r):>12}" for r in args.rows))
    gen = torch.Generator().manual_seed(0)
    runs = {rows: layer_lora(rows, args.slots, args.rank, gen) for rows in args.rows}
    with torch.inference_mode():
        for name, lora_apply in paths.items():
            cells = [best_time_s(lambda run=run: run(lora_apply), args.reps) * 1e6 for run in runs.values()]
            print(f"{name:16}" + "".join(f"{us:12.1f}" for us in cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
