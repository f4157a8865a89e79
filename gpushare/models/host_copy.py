"""Moving a built model between a GPU and host memory (the warm tier), without rebuilding it.

On the CPU a model already lives in host RAM: both moves are no-ops. On CUDA, `to_host` copies
the weights into pinned host memory, freeing the device memory, and `to_device` copies them back
(a PCIe copy, no parsing or dequantising).
"""

import torch


def _move_tensors(module: torch.nn.Module, move) -> None:
    """Replace every parameter's and buffer's storage by `move(tensor)`, in place: tied weights
    (one Parameter in two modules) stay tied, and every module keeps its own objects."""
    for p in module.parameters():
        p.data = move(p.data)
    for sub in module.modules():
        for name, buf in list(sub.named_buffers(recurse=False)):
            setattr(sub, name, move(buf))


def to_host(loaded):
    """The LoadedModel with its weights in host memory (pinned, for a fast copy back)."""
    if loaded.device == "cpu":
        return loaded
    _move_tensors(loaded.model, lambda t: t.to("cpu").pin_memory())
    torch.cuda.empty_cache()
    return loaded


def to_device(loaded, device: str):
    """The warm LoadedModel back on `device`, ready for engine.add_model."""
    if device != "cpu":
        _move_tensors(loaded.model, lambda t: t.to(device, non_blocking=True))
        torch.cuda.synchronize(device)
    return loaded
