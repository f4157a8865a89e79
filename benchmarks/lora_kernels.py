"""Batched LoRA alone, per path (torch, the C++ kernel, the Triton one): us per model step's LoRA at
1, 16 and 64 rows, and each path's largest difference from the torch path.

    .venv/bin/python benchmarks/lora_kernels.py                       # CPU: torch and C++
    .venv/bin/python benchmarks/lora_kernels.py --rows 1 --threads 1 --reps 50
    python benchmarks/lora_kernels.py --device cuda                   # GPU: torch and Triton

One step's LoRA of one SmolLM2-135M layer's targets (q 576, k 192, v 192 and o 576 wide on hidden
576; gate and up 1536 wide on 576; down 576 wide on 1536), 16 slots of rank 16 (bfloat16 stacks, as
a quantized base's; ``--stacks float32`` as the exact path's), each row's slot drawn at random; q,
k and v go into column slices of one fused qkv output, gate and up into one gate_up output, as the
model's linears pass them. Each figure is the best of ``--reps`` passes
(models/cpu_kernels.best_time_s; on CUDA each pass ends in a synchronize). Run it with nothing else
running.
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


def layer_lora(rows: int, slots: int, rank: int, stacks_dtype: torch.dtype, gen: torch.Generator, device: str):
    """A function that runs ``lora_apply`` (given) on every target of one layer, adding into the
    layer's outputs (``fresh``: copies of them, returned; else in place, as timed)."""
    work = []
    for parts in LINEARS.values():
        y = torch.randn(rows, sum(out for out, _ in parts), generator=gen)
        x = torch.randn(rows, parts[0][1], generator=gen).to(device)
        start, stacks = 0, []
        for out, inp in parts:
            stacks.append((start, out, (torch.randn(slots, rank, inp, generator=gen) / 10).to(device, stacks_dtype),
                           (torch.randn(slots, rank, out, generator=gen) / 10).to(device, stacks_dtype)))
            start += out
        work.append((y.to(device), x, stacks))
    slot_of_row = torch.randint(0, slots, (rows,), generator=gen, dtype=torch.int32).to(device)
    scale_of_slot = torch.full((slots,), 2.0, device=device)

    def run(lora_apply, fresh: bool = False) -> list[torch.Tensor]:
        outputs = [y.clone() if fresh else y for y, _, _ in work]
        for y, (_, x, stacks) in zip(outputs, work):
            for start, out, a_stack, b_stack in stacks:
                lora_apply(y.narrow(1, start, out), x, a_stack, b_stack, slot_of_row, scale_of_slot)
        if device == "cuda":
            torch.cuda.synchronize()
        return outputs

    return run


def paths(names: list[str]) -> dict:
    """``lora_apply`` of each path named: torch (as the dispatch runs it on a column slice), cpp, triton."""
    found = {}
    for name in names:
        if name == "torch":
            found[name] = torch_path
        elif name == "cpp" and cpu_ops.loaded():
            found[f"C++ ({cpu_ops.isa()})"] = torch.ops.gpushare.lora_apply
        elif name == "triton":
            from gpushare.kernels import lora_triton
            found["Triton"] = lora_triton.lora_apply
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", type=int, default=[1, 16, 64])
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--stacks", default="bfloat16", choices=["bfloat16", "float32"], help="the stacks' dtype")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--paths", nargs="+", choices=["torch", "cpp", "triton"],
                   help="default: torch and cpp on the CPU, torch and triton on CUDA")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    chosen = paths(args.paths or ["torch", "cpp" if args.device == "cpu" else "triton"])
    print(f"us per layer's LoRA (7 targets), {args.slots} {args.stacks} slots of rank {args.rank}, "
          f"best of {args.reps}, "
          f"{args.device}{f', {args.threads} threads' if args.device == 'cpu' else ''}; max |difference| from torch")
    print(f"{'path':16}" + "".join(f"{'rows ' + str(r):>24}" for r in args.rows))
    gen = torch.Generator().manual_seed(0)
    stacks_dtype = getattr(torch, args.stacks)
    runs = {rows: layer_lora(rows, args.slots, args.rank, stacks_dtype, gen, args.device) for rows in args.rows}
    with torch.inference_mode():
        for name, lora_apply in chosen.items():
            cells = []
            for run in runs.values():
                pairs = zip(run(lora_apply, fresh=True), run(torch_path, fresh=True))
                difference = max((got - want).abs().max().item() for got, want in pairs)
                us = best_time_s(lambda run=run: run(lora_apply), args.reps) * 1e6
                cells.append(f"{us:10.1f} | {difference:8.1e}")
            print(f"{name:16}" + "".join(f"{c:>24}" for c in cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
