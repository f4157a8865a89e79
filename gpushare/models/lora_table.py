"""A model's loaded LoRA adapters as the batched kernel (kernels.lora_apply) takes them: one slot per
adapter, each target linear's A and B stacked over the slots and padded to the largest rank loaded
for that target (rank 0, nothing to read, where no loaded adapter has it).

The fused projections hold several targets (q, k, v in ``qkv_proj``; gate, up in ``gate_up_proj``): each
target is a column range of the linear's output with stacks of its own. A slot's missing target is zeros,
which add nothing. Slots are renumbered when an adapter goes; steps look slots up by name as they start.

The stacks are bfloat16 (as vLLM keeps LoRA weights in the model's dtype: half the bytes a step reads),
except on the exact path, a base of float32 weights under float32 activations, where they stay float32
so that the adapters add exactly what peft's do. An adapter's weights are kept in the stacks' dtype.
"""

from dataclasses import dataclass

import torch

from gpushare import kernels
from gpushare.models.lora import LoraAdapter, fit_to_base, target_shape

# linear -> its targets in output-column order
PARTS = {"self_attn.qkv_proj": ("q", "k", "v"), "self_attn.o_proj": ("o",),
         "mlp.gate_up_proj": ("gate", "up"), "mlp.down_proj": ("down",)}


def stack_dtype(model) -> torch.dtype:
    """float32 for a base that runs exact (float32 activations, every target linear's weight float32:
    dense, or oneDNN's packing of a float32 weight), else bfloat16."""
    linears = [layer.get_submodule(path) for layer in model.layers for path in PARTS]
    exact = model.norm.weight.dtype == torch.float32 and all(
        linear.format == "onednn" or (linear.format == "dense" and linear.weight.dtype == torch.float32)
        for linear in linears)
    return torch.float32 if exact else torch.bfloat16


@dataclass
class LinearLora:
    """One linear's adapters: ``parts`` of (first output column, width, a_stack, b_stack)."""

    parts: list
    scale_of_slot: torch.Tensor  # [slots] float32

    def apply(self, y: torch.Tensor, x: torch.Tensor, slot_of_row: torch.Tensor) -> None:
        for start, width, a_stack, b_stack in self.parts:
            kernels.lora_apply(y.narrow(1, start, width), x, a_stack, b_stack, slot_of_row, self.scale_of_slot)


class AdapterTable:
    """The adapters loaded on one model, by name; slot = position in load order."""

    def __init__(self, model, base_name: str):
        self.model, self.base_name = model, base_name
        self.adapters: dict[str, LoraAdapter] = {}
        # every target's stacks, layer after layer in PARTS' order (seven a layer): the fused decode's
        self.a_stacks: list[torch.Tensor] = []
        self.b_stacks: list[torch.Tensor] = []
        self.scale_of_slot = torch.zeros(0)  # host: empty until rebuild makes it on the model's device

    def add(self, adapter: LoraAdapter) -> None:
        """Load ``adapter``; ValueError (naming both) if it does not fit this base or is loaded already."""
        if adapter.name in self.adapters:
            raise ValueError(f"adapter {adapter.name!r} is already loaded on {self.base_name!r}")
        fit_to_base(adapter, self.model.config, self.base_name)
        dtype = stack_dtype(self.model)  # kept as the stacks hold it: what its bytes are
        adapter.weights = {key: (a.to(dtype), b.to(dtype)) for key, (a, b) in adapter.weights.items()}
        self.adapters[adapter.name] = adapter
        self.rebuild()

    def remove(self, name: str) -> None:
        if self.adapters.pop(name, None) is not None:
            self.rebuild()

    def slot(self, name: str | None) -> int:
        """The slot of adapter ``name``, -1 for the base alone (None); KeyError if it is not loaded."""
        if name is None:
            return -1
        if name not in self.adapters:
            raise KeyError(f"adapter {name!r} is not loaded on {self.base_name!r}")
        return list(self.adapters).index(name)

    def nbytes(self, name: str) -> int:
        """Adapter ``name``'s weights' bytes in the stacks' dtype (its slot's padding to a larger loaded
        rank not counted): what counts against the memory budget and /api/ps shows."""
        return self.adapters[name].nbytes

    def rebuild(self) -> None:
        """Every target linear's stacks from the loaded adapters (None on all of them when there are none)."""
        adapters = list(self.adapters.values())
        device = self.model.norm.weight.device
        dtype = stack_dtype(self.model)
        scales = torch.tensor([a.scale for a in adapters], dtype=torch.float32, device=device)
        self.a_stacks, self.b_stacks, self.scale_of_slot = [], [], scales
        for i, layer in enumerate(self.model.layers):
            for path, targets in PARTS.items():
                linear = layer.get_submodule(path)
                if not adapters:
                    linear.lora = None
                    continue
                parts, start = [], 0
                for target in targets:
                    out_features, in_features = target_shape(self.model.config, target)
                    # rank 0 where no loaded adapter has this target (PEFT's default adapts q and v
                    # only): its kernel call returns at once, never reading slots of zeros
                    width = max((a.rank for a in adapters if (i, target) in a.weights), default=0)
                    a_stack = torch.zeros(len(adapters), width, in_features, dtype=dtype, device=device)
                    b_stack = torch.zeros(len(adapters), width, out_features, dtype=dtype, device=device)
                    for s, adapter in enumerate(adapters):
                        pair = adapter.weights.get((i, target))
                        if pair is not None:
                            a_stack[s, :adapter.rank] = pair[0]
                            b_stack[s, :adapter.rank] = pair[1].T
                    parts.append((start, out_features, a_stack, b_stack))
                    self.a_stacks.append(parts[-1][2])
                    self.b_stacks.append(parts[-1][3])
                    start += out_features
                linear.lora = LinearLora(parts, scales)
