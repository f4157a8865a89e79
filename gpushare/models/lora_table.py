"""A model's loaded LoRA adapters as the batched kernel (kernels.lora_apply) takes them: one slot per
adapter, each target linear's A and B stacked over the slots and padded to the largest loaded rank.

The fused projections hold several targets (q, k, v in ``qkv_proj``; gate, up in ``gate_up_proj``): each
target is a column range of the linear's output with stacks of its own. A slot's missing target is zeros,
which add nothing. Slots are renumbered when an adapter goes; steps look slots up by name as they start.
"""

from dataclasses import dataclass

import torch

from gpushare import kernels
from gpushare.models.lora import LoraAdapter, fit_to_base, target_shape

# linear -> its targets in output-column order
PARTS = {"self_attn.qkv_proj": ("q", "k", "v"), "self_attn.o_proj": ("o",),
         "mlp.gate_up_proj": ("gate", "up"), "mlp.down_proj": ("down",)}


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
        self.scale_of_slot = torch.zeros(0)

    def add(self, adapter: LoraAdapter) -> None:
        """Load ``adapter``; ValueError (naming both) if it does not fit this base or is loaded already."""
        if adapter.name in self.adapters:
            raise ValueError(f"adapter {adapter.name!r} is already loaded on {self.base_name!r}")
        fit_to_base(adapter, self.model.config, self.base_name)
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
        return self.adapters[name].nbytes

    def rebuild(self) -> None:
        """Every target linear's stacks from the loaded adapters (None on all of them when there are none)."""
        adapters = list(self.adapters.values())
        device = self.model.norm.weight.device
        rank = max((a.rank for a in adapters), default=0)
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
                    a_stack = torch.zeros(len(adapters), rank, in_features)
                    b_stack = torch.zeros(len(adapters), rank, out_features)
                    for s, adapter in enumerate(adapters):
                        pair = adapter.weights.get((i, target))
                        if pair is not None:
                            a_stack[s, :adapter.rank] = pair[0]
                            b_stack[s, :adapter.rank] = pair[1].T
                    parts.append((start, out_features, a_stack.to(device), b_stack.to(device)))
                    self.a_stacks.append(parts[-1][2])
                    self.b_stacks.append(parts[-1][3])
                    start += out_features
                linear.lora = LinearLora(parts, scales)
