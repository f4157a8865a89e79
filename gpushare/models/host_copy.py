"""Moving a built model between a GPU and host memory (the warm tier), without rebuilding it.

On the CPU a model already lives in host RAM: both moves are no-ops. On CUDA, `to_host` copies
the weights into pinned host memory, freeing the device memory, and `to_device` copies them back
(a PCIe copy, no parsing or dequantising). Both copy on a CUDA stream of their own (`copy_plan`):
on the default stream the copies would queue with serving's kernels, and waiting for them would
wait for every step in flight; a side stream lets the engine keep stepping while weights move.
"""

from dataclasses import dataclass

import torch


@dataclass
class CopyPlan:
    """How a warm-tier move to or from ``device`` copies."""
    device: str
    pin_memory: bool  # the host side page-locked: a DMA copy, at full PCIe speed, asynchronous to the host
    side_stream: bool  # on a stream of its own, not the default stream serving's kernels run on


def copy_plan(device: str) -> CopyPlan | None:
    """None where there is nothing to copy (a CPU model is in host memory already)."""
    if not device.startswith("cuda"):
        return None
    return CopyPlan(device, pin_memory=True, side_stream=True)


def _slots(module: torch.nn.Module) -> list:
    """(tensor, put) for every parameter and buffer: put(new) replaces its storage in place, so tied
    weights (one Parameter in two modules) stay tied and every module keeps its own objects."""
    slots = [(p.data, lambda new, p=p: setattr(p, "data", new)) for p in module.parameters()]
    for sub in module.modules():
        for name, buf in list(sub.named_buffers(recurse=False)):
            slots.append((buf, lambda new, sub=sub, name=name: setattr(sub, name, new)))
    return slots


def _copy(module: torch.nn.Module, plan: CopyPlan, to: str, cuda=torch.cuda) -> None:
    """Every tensor of `module` copied to `to` ("cpu" or plan.device) as `plan` says; returns once done.
    Every destination is allocated first, outside the side stream, so the allocator ties device memory
    to the default stream serving uses; then the side stream waits for what is queued there (the
    model's last step, the last users of memory just handed back), copies, and only this thread
    waits for it. The sources stay referenced until the copies are done. ``cuda``: torch.cuda's
    stream API (the hardware boundary)."""
    slots = _slots(module)
    pinned = plan.pin_memory and to == "cpu"
    outs = {}
    for t, _ in slots:  # a buffer two modules share is copied once
        if id(t) not in outs:
            outs[id(t)] = torch.empty(t.shape, dtype=t.dtype, device=to, pin_memory=pinned)
    default = cuda.current_stream(plan.device)
    stream = cuda.Stream(plan.device) if plan.side_stream else default
    stream.wait_stream(default)
    with cuda.stream(stream):
        for t, _ in slots:
            outs[id(t)].copy_(t, non_blocking=True)
    stream.synchronize()
    for t, put in slots:
        put(outs[id(t)])


def to_host(loaded):
    """The LoadedModel with its weights in host memory (pinned, for a fast copy back)."""
    plan = copy_plan(loaded.device)
    if plan is None:
        return loaded
    _copy(loaded.model, plan, "cpu")
    torch.cuda.empty_cache()
    return loaded


def to_device(loaded, device: str):
    """The warm LoadedModel back on `device`, ready for engine.add_model."""
    plan = copy_plan(device)
    if plan is not None:
        _copy(loaded.model, plan, device)
    return loaded
