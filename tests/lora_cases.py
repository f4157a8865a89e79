"""Batched LoRA on fixed inputs, for test_lora_kernels and the ISA battery: ranks 8, 16 and 64 (and a
rank-8 adapter padded into a rank-16 stack), 1, 7 and 64 rows of mixed slots with base rows (-1),
float32 and bfloat16 rows, ``y`` whole or a column slice of a wider output (as the fused qkv's), on
float32 stacks and (at rank 16) on bfloat16 ones, as a quantized base's adapters are stored.

Run as a script with ``GPUSHARE_CPU_ISA`` set, it saves the C++ kernel's output of every case at 1 and
2 threads, so that test_lora_kernels can check each ISA's build against the torch reference:

    GPUSHARE_CPU_ISA=avx2 python tests/lora_cases.py OUT.pt
"""

import sys
from dataclasses import dataclass

import torch

SLOTS = 5
IN_FEATURES, OUT_FEATURES = 96, 80  # not multiples of the kernels' tiles: their tails run too
WIDE = 200  # a sliced y's whole row; the slice is columns SLICE_START .. SLICE_START + OUT_FEATURES
SLICE_START = 40
THREADS = (1, 2)


@dataclass
class Case:
    name: str
    y: torch.Tensor  # the whole output (WIDE columns when sliced), left as it was: apply to a clone
    x: torch.Tensor
    a_stack: torch.Tensor
    b_stack: torch.Tensor
    slot_of_row: torch.Tensor
    scale_of_slot: torch.Tensor
    sliced: bool

    def target(self, y: torch.Tensor) -> torch.Tensor:
        """The columns of ``y`` (a clone of the case's) that the adapters go to."""
        return y.narrow(1, SLICE_START, OUT_FEATURES) if self.sliced else y

    def run(self, lora_apply) -> torch.Tensor:
        """The whole ``y`` after ``lora_apply`` on a clone of it."""
        y = self.y.clone()
        lora_apply(self.target(y), self.x, self.a_stack, self.b_stack, self.slot_of_row, self.scale_of_slot)
        return y


def stacks(rank: int, adapter_rank: int, gen: torch.Generator, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A and B stacks in ``dtype`` of SLOTS adapters of rank ``adapter_rank`` padded with zeros to ``rank``."""
    a_stack, b_stack = torch.zeros(SLOTS, rank, IN_FEATURES), torch.zeros(SLOTS, rank, OUT_FEATURES)
    a_stack[:, :adapter_rank] = torch.randn(SLOTS, adapter_rank, IN_FEATURES, generator=gen) / 10
    b_stack[:, :adapter_rank] = torch.randn(SLOTS, adapter_rank, OUT_FEATURES, generator=gen) / 10
    return a_stack.to(dtype), b_stack.to(dtype)


def cases() -> list[Case]:
    gen = torch.Generator().manual_seed(39)
    out = []
    for rank, adapter_rank, stack_dtype in [(8, 8, torch.float32), (16, 16, torch.float32), (16, 8, torch.float32),
                                            (64, 64, torch.float32), (16, 16, torch.bfloat16),
                                            (16, 8, torch.bfloat16)]:
        a_stack, b_stack = stacks(rank, adapter_rank, gen, stack_dtype)
        scale_of_slot = torch.rand(SLOTS, generator=gen) + 0.5
        for rows in (1, 7, 64):
            slot_of_row = torch.randint(-1, SLOTS, (rows,), generator=gen, dtype=torch.int32)
            if rows > 1:
                slot_of_row[:2] = torch.tensor([-1, SLOTS - 1])  # a base row and the last slot in every batch
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(rows, IN_FEATURES, generator=gen).to(dtype)
                for sliced in (False, True):
                    y = torch.randn(rows, WIDE if sliced else OUT_FEATURES, generator=gen).to(dtype)
                    name = (f"lora rank{rank} adapter-rank{adapter_rank}"
                            f"{' bfloat16-stacks' if stack_dtype == torch.bfloat16 else ''} rows{rows} "
                            f"{str(dtype).removeprefix('torch.')}{' sliced' if sliced else ''}")
                    out.append(Case(name, y, x, a_stack, b_stack, slot_of_row, scale_of_slot, sliced))
    return out


def cpp_outputs() -> dict[str, torch.Tensor]:
    """Each case's whole ``y`` after the C++ kernel, by case name and thread count."""
    outputs = {}
    for threads in THREADS:
        torch.set_num_threads(threads)
        for case in cases():
            outputs[f"{case.name} threads{threads}"] = case.run(torch.ops.gpushare.lora_apply)
    return outputs


def main(path: str) -> int:
    from gpushare.kernels import cpu_ops

    assert cpu_ops.loaded(), "the C++ kernels did not build"
    torch.save({"isa": cpu_ops.isa(), "cases": cpp_outputs()}, path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
