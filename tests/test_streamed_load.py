"""A load streams the model to its device tensor by tensor: the host never holds the whole model.

The target here is torch's meta device (no memory at all), so every byte a load still holds on the
host is one the loader kept: counted after each tensor is read, from the live tensors themselves."""

import gc

import torch

from gpushare.models.loader import load_model


def _host_tensor_bytes() -> int:
    """Bytes of the distinct host storages behind every live tensor of this process."""
    storages = {}
    for obj in gc.get_objects():
        # type(), not isinstance(): a lazy module object answers isinstance through a deprecated getattr
        if not issubclass(type(obj), torch.Tensor) or obj.device.type != "cpu" or obj.layout != torch.strided:
            continue
        try:
            storage = obj.untyped_storage()
        except (NotImplementedError, RuntimeError):  # opaque tensors (mkldnn, ...) other tests left alive
            continue
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def test_a_load_holds_at_most_one_tensor_on_the_host(smollm2_path):
    before = _host_tensor_bytes()
    held = []
    reads = 0

    def progress(done_bytes, total_bytes):  # called after each tensor is read and placed
        nonlocal reads
        reads += 1
        if reads % 64 == 0 or done_bytes == total_bytes:
            held.append(_host_tensor_bytes() - before)

    loaded = load_model(smollm2_path, dtype="float32", device="meta", weights="int8", progress=progress)
    largest = max(t.numel() * t.element_size() for t in [*loaded.model.parameters(), *loaded.model.buffers()])
    assert len(held) >= 4
    assert max(held) <= largest, (f"the host held {max(held) / 2**20:.1f} MiB while loading a "
                                  f"{loaded.weight_bytes / 2**20:.1f} MiB model (largest tensor "
                                  f"{largest / 2**20:.1f} MiB)")
    assert {t.device.type for t in [*loaded.model.parameters(), *loaded.model.buffers()]} == {"meta"}
