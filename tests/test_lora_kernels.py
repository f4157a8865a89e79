"""The batched LoRA kernels against the torch reference (kernels/lora_torch.py): the C++ one
(cpu_lora.cpp) built for every instruction set this machine runs, and the Triton one under
``TRITON_INTERPRET=1``, on the cases of tests/lora_cases.py (ranks 8 to 64, 1 to 64 rows of mixed
slots and base rows, float32 and bfloat16, a column slice of a wider output). Base rows and the
columns outside the slice come back bit for bit as they were. That every ISA's build gives the same
bits is test_cpu_isa's (its battery holds these cases)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

from pathlib import Path

import pytest
import torch

import lora_cases
from gpushare import kernels
from gpushare.kernels import cpu_ops, lora_torch, lora_triton
from isa_runs import outputs_by_isa

CASES = lora_cases.cases()
ISAS = cpu_ops.runnable_isas()
needs_compiler = pytest.mark.skipif(cpu_ops._compiler() is None, reason="no C++ compiler here")


def torch_path(y, x, a_stack, b_stack, slot_of_row, scale_of_slot):
    y.copy_(lora_torch.lora_apply(y.contiguous(), x, a_stack, b_stack, slot_of_row, scale_of_slot))


def check(case: lora_cases.Case, got: torch.Tensor) -> None:
    """``got`` (the case's whole ``y`` after a kernel) equals the torch path's within the dtype's
    rounding, and is untouched outside the adapter rows' target columns."""
    want = case.run(torch_path)
    if case.y.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        # the delta is rounded to bfloat16 before the add (by Triton's interpreter, truncated: up to two
        # steps), and another sum order may round it the other way: steps of the operands' size, which
        # stay when y and the delta cancel, so the tolerance is relative to them, not to the result
        operands = case.y.float().abs() + want.float().abs()
        assert ((got.float() - want.float()).abs() <= 1e-2 + 1.6e-2 * operands).all(), case.name
    touched = torch.zeros(case.y.shape, dtype=torch.bool)
    case.target(touched)[case.slot_of_row >= 0] = True
    assert torch.equal(got[~touched], case.y[~touched])
    assert not torch.equal(got[touched], case.y[touched]) or not touched.any()


@pytest.fixture(scope="module")
def isa_outputs(tmp_path_factory) -> dict:
    """Each runnable ISA's C++ outputs on the cases (built, where this machine has no such build yet, all at once)."""
    return outputs_by_isa(Path(__file__).with_name("lora_cases.py"), tmp_path_factory.mktemp("lora-isa"))


@needs_compiler
@pytest.mark.parametrize("isa", ISAS)
def test_cpp_kernel_matches_torch_on_every_isa(isa_outputs, isa):
    out = isa_outputs[isa]
    assert out["isa"] == isa
    for case in CASES:
        for threads in lora_cases.THREADS:
            check(case, out["cases"][f"{case.name} threads{threads}"])


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_triton_kernel_matches_torch(case):
    check(case, case.run(lora_triton.lora_apply))


@pytest.mark.parametrize("path", ["", "torch", "triton"])
def test_dispatch_adds_adapters_into_a_column_slice_on_every_path(monkeypatch, path):
    monkeypatch.setenv("GPUSHARE_KERNELS", path)
    for case in CASES:
        if case.sliced and case.slot_of_row.numel() == 7:
            check(case, case.run(kernels.lora_apply))


@needs_compiler
def test_cpp_kernel_refuses_a_slot_it_has_not():
    assert cpu_ops.loaded()
    case = CASES[0]
    bad = torch.tensor([lora_cases.SLOTS], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="has slot 5 of 5"):
        torch.ops.gpushare.lora_apply(case.y.clone(), case.x, case.a_stack, case.b_stack, bad, case.scale_of_slot)
