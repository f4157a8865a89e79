"""Batched LoRA in plain torch: the reference for the C++ and Triton kernels that add each row's
own adapter to a linear's output in one call (the base weight's product is computed once for all).

Layout (produced by the adapter loader, shared with the other kernels):

- ``a_stack`` ``[slots, rank, in_features]`` and ``b_stack`` ``[slots, rank, out_features]`` (B
  transposed: a rank's output columns contiguous, so the expand runs along them): one slot per
  loaded adapter, ranks below ``rank`` padded with zeros (a zero row of A and of B add nothing);
  both float32 or both bfloat16 (models/lora_table.py chooses), widened to float32 as they are read,
  every sum in float32;
- ``slot_of_row`` int32 ``[rows]``: the slot of each row's adapter, ``-1`` for the base alone;
- ``scale_of_slot`` float32 ``[slots]``: ``lora_alpha / r`` of each slot's adapter.

``y[t] += scale_of_slot[s] * b_stack[s].T @ (a_stack[s] @ x[t])`` for each row ``t`` with
``s = slot_of_row[t] >= 0``; other rows are left as they are.
"""

import torch


def lora_apply(y, x, a_stack, b_stack, slot_of_row, scale_of_slot):
    """Add each row's adapter product to ``y [rows, out]`` in place, from ``x [rows, in]``."""
    for slot in torch.unique(slot_of_row).tolist():
        if slot < 0:
            continue
        rows = (slot_of_row == slot).nonzero().squeeze(1)
        shrunk = x[rows].to(torch.float32) @ a_stack[slot].float().T
        y[rows] += (scale_of_slot[slot] * (shrunk @ b_stack[slot].float())).to(y.dtype)
    return y
