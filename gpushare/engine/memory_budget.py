"""The node memory budget: a model's size before it loads, the default budget, whom to evict.

One budget (memory.budget) covers the weights and KV pools of every loaded model: device
memory on a GPU, host RAM on the CPU. Before a load the weight bytes are estimated from
the file's tensor table (parameter count x dtype size), read straight from the GGUF
header or the safetensors headers: gguf's own reader takes seconds on a large vocabulary,
this takes milliseconds. The registry replaces the estimate with the real number once
the model has loaded.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from dataclasses import dataclass

import torch

DEFAULT_GPU_BUDGET_FRACTION = 0.9  # of the device's memory: the CUDA context and allocator slack need the rest
DEFAULT_CPU_BUDGET_FRACTION = 0.8  # of the host RAM available at start

# GGUF metadata value types (gguf spec): fixed sizes in bytes; 8 = string, 9 = array.
_GGUF_FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


@dataclass
class TensorCount:
    parameters: int  # elements of every weight tensor in the file
    tied_embedding: int  # elements of the input embedding when no separate output matrix exists, else 0


def _read_exact(f, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise ValueError("truncated")
    return data


def _skip_gguf_value(f, value_type: int) -> None:
    if value_type in _GGUF_FIXED_SIZES:
        f.seek(_GGUF_FIXED_SIZES[value_type], os.SEEK_CUR)
    elif value_type == _GGUF_STRING:
        (length,) = struct.unpack("<Q", _read_exact(f, 8))
        f.seek(length, os.SEEK_CUR)
    elif value_type == _GGUF_ARRAY:
        item_type, count = struct.unpack("<IQ", _read_exact(f, 12))
        if item_type in _GGUF_FIXED_SIZES:
            f.seek(_GGUF_FIXED_SIZES[item_type] * count, os.SEEK_CUR)
        else:
            for _ in range(count):
                _skip_gguf_value(f, item_type)
    else:
        raise ValueError(f"unknown metadata value type {value_type}")


def count_gguf_tensors(path: str) -> TensorCount:
    """Element counts from a GGUF (v2/v3) header: metadata is skipped, the tensor table read."""
    try:
        with open(path, "rb") as f:
            magic, version = struct.unpack("<4sI", _read_exact(f, 8))
            if magic != b"GGUF" or version < 2:
                raise ValueError("not a GGUF v2/v3 file" if magic == b"GGUF" else "bad magic")
            num_tensors, num_kv = struct.unpack("<QQ", _read_exact(f, 16))
            for _ in range(num_kv):
                (key_length,) = struct.unpack("<Q", _read_exact(f, 8))
                f.seek(key_length, os.SEEK_CUR)
                (value_type,) = struct.unpack("<I", _read_exact(f, 4))
                _skip_gguf_value(f, value_type)
            elements = {}
            for _ in range(num_tensors):
                (name_length,) = struct.unpack("<Q", _read_exact(f, 8))
                name = _read_exact(f, name_length).decode()
                (num_dims,) = struct.unpack("<I", _read_exact(f, 4))
                dims = struct.unpack(f"<{num_dims}Q", _read_exact(f, 8 * num_dims))
                f.seek(12, os.SEEK_CUR)  # ggml type (u32), data offset (u64)
                count = 1
                for d in dims:
                    count *= d
                elements[name] = count
    except (ValueError, struct.error, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: corrupt or truncated GGUF header ({e})") from None
    tied = elements.get("token_embd.weight", 0) if "output.weight" not in elements else 0
    return TensorCount(sum(elements.values()), tied)


def count_safetensors(folder: str) -> TensorCount:
    """Element counts from the JSON headers of a folder's *.safetensors files."""
    elements = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        try:
            with open(path, "rb") as f:
                (header_length,) = struct.unpack("<Q", _read_exact(f, 8))
                header = json.loads(_read_exact(f, header_length))
        except (ValueError, struct.error) as e:
            raise ValueError(f"{path}: corrupt safetensors header ({e})") from None
        for name, info in header.items():
            if name != "__metadata__":
                count = 1
                for d in info["shape"]:
                    count *= d
                elements[name] = count
    if not elements:
        raise ValueError(f"{folder}: no *.safetensors files")
    tied = elements.get("model.embed_tokens.weight", 0) if "lm_head.weight" not in elements else 0
    return TensorCount(sum(elements.values()), tied)


def count_tensors(path: str) -> TensorCount:
    return count_safetensors(path) if os.path.isdir(path) else count_gguf_tensors(path)


def estimate_weight_bytes(count: TensorCount, dtype: str) -> int:
    """Weight bytes once loaded in `dtype`. A tied output matrix counts twice: on the CPU in
    float32 the oneDNN packing keeps its own copy of it; elsewhere this over-estimates by one
    embedding, which the real number after the load gives back."""
    element_bytes = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return (count.parameters + count.tied_embedding) * element_bytes


def default_budget_bytes(device: str, host_cache_bytes: int) -> int:
    """memory.budget when the config leaves it out: 90% of the GPU's memory; on the CPU 80% of
    the RAM available now, less the warm tier's share."""
    if device.startswith("cuda"):
        _, total = torch.cuda.mem_get_info(torch.device(device))
        return int(total * DEFAULT_GPU_BUDGET_FRACTION)
    import psutil

    return max(int(psutil.virtual_memory().available * DEFAULT_CPU_BUDGET_FRACTION) - host_cache_bytes, 0)


@dataclass
class Resident:
    """A loaded model as the eviction plan sees it."""
    name: str
    size_bytes: int
    last_used: float
    evictable: bool  # idle (no running or queued request) and not pinned


def plan_evictions(residents: list[Resident], need_bytes: int, used_bytes: int, budget_bytes: int,
                   max_models: int, num_models: int) -> list[Resident] | None:
    """The idle models to unload, least recently used first, so that `need_bytes` more fits in
    the budget and one more model fits under max_models; None when that is not possible now."""
    candidates = sorted((r for r in residents if r.evictable), key=lambda r: r.last_used)
    victims = []
    while used_bytes + need_bytes > budget_bytes or num_models >= max_models:
        if not candidates:
            return None
        victim = candidates.pop(0)
        victims.append(victim)
        used_bytes -= victim.size_bytes
        num_models -= 1
    return victims
