"""The node memory budget: a model's size before it loads, the default budget, whom to evict.

One budget (memory.budget) covers the weights and KV pools of every loaded model: device
memory on a GPU, host RAM on the CPU. Before a load the weight bytes are estimated from
the file's tensor table (parameter count x bytes per weight of the model's weight format):
the GGUF header, or the JSON headers of the safetensors files; no tensor data is read. The registry replaces the
estimate with the real number once the model has loaded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import struct
from dataclasses import dataclass

from gpushare.catalog.model_files import ModelFileError, open_regular, weight_files, without_paths
from gpushare.residency.entries import ModelLoadError

log = logging.getLogger("gpushare.registry")

DEFAULT_CPU_BUDGET_FRACTION = 0.8  # of the host RAM available at start
MAX_SAFETENSORS_HEADER_BYTES = 100_000_000  # the safetensors format's own cap on its JSON header
# Reading a model's header (its tensor table, its config): seconds for a file that is slow to read
# (a stalled network mount). FIFOs and devices are refused at open (catalog/model_files.py).
HEADER_READ_TIMEOUT_S = 60.0


@dataclass
class TensorCount:
    parameters: int  # elements of every weight tensor in the file
    tied_embedding: int  # elements of the input embedding when no separate output matrix exists, else 0
    source_types: frozenset = frozenset()  # GGUF type names of the matrices (empty: dense safetensors)


def _read_exact(f, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise ValueError("truncated")
    return data


def count_gguf_tensors(path: str) -> TensorCount:
    """Element counts from a GGUF's tensor table (no tensor data is read)."""
    from gpushare.catalog.gguf_reader import open_gguf

    _, tensors = open_gguf(path)
    elements = {t.name: math.prod(t.shape) for t in tensors}
    tied = elements.get("token_embd.weight", 0) if "output.weight" not in elements else 0
    types = frozenset(t.tensor_type.name for t in tensors if len(t.shape) == 2)
    return TensorCount(sum(elements.values()), tied, types)


def count_safetensors(folder: str) -> TensorCount:
    """Element counts from the JSON headers of a folder's *.safetensors files: each a regular file in
    the folder (a FIFO would block this thread for ever), its header at most MAX_SAFETENSORS_HEADER_BYTES."""
    elements = {}
    for path in weight_files(folder):
        name = os.path.basename(path)
        try:
            with open_regular(path, name) as f:
                (header_length,) = struct.unpack("<Q", _read_exact(f, 8))
                if header_length > MAX_SAFETENSORS_HEADER_BYTES:
                    raise ValueError(f"its header claims {header_length} bytes, over the format's "
                                     f"{MAX_SAFETENSORS_HEADER_BYTES}")
                header = json.loads(_read_exact(f, header_length))
        except ModelFileError:
            raise
        except (ValueError, struct.error) as e:
            raise ValueError(f"{name}: corrupt safetensors header ({e})") from None
        elements.update((name, math.prod(info["shape"])) for name, info in header.items() if name != "__metadata__")
    if not elements:
        raise ValueError(f"{os.path.basename(folder)}: no *.safetensors files")
    tied = elements.get("model.embed_tokens.weight", 0) if "lm_head.weight" not in elements else 0
    return TensorCount(sum(elements.values()), tied)


def count_tensors(path: str) -> TensorCount:
    return count_safetensors(path) if os.path.isdir(path) else count_gguf_tensors(path)


async def read_tensor_count(what: str, path: str) -> TensorCount:
    """count_tensors off the event loop within HEADER_READ_TIMEOUT_S; ModelLoadError (refused: a 422)
    naming `what` (`model "NAME"`) when its files are refused or too slow to read."""
    try:
        return await asyncio.wait_for(asyncio.to_thread(count_tensors, path), HEADER_READ_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise ModelLoadError(f"failed to load {what}: its files took over {HEADER_READ_TIMEOUT_S:g}s to read",
                             refused=True) from None
    except (OSError, ValueError) as e:
        log.warning("sizing %s (%s) failed: %s", what, path, e)
        raise ModelLoadError(f"failed to load {what}: {without_paths(str(e), path)}", refused=True) from e


# bytes per weight of the quantized formats, scales included: int4 keeps two float32 numbers per
# group of 32 (0.25 bytes a weight) and its output matrix in int8
_QUANTIZED_BYTES_PER_WEIGHT = {"int8": 1.0, "int4": 0.8}
_DENSE_BYTES_PER_WEIGHT = {"float32": 4, "bfloat16": 2, "float16": 2}


def estimate_weight_bytes(count: TensorCount, weights: str) -> int:
    """Weight bytes once loaded in the (resolved) weight format `weights`. Dense: a tied output
    matrix counts twice: on the CPU in float32 the oneDNN packing keeps its own copy of it;
    elsewhere this over-estimates by one embedding, which the real number after the load gives
    back. Quantized: one tied copy serves both."""
    if weights in _QUANTIZED_BYTES_PER_WEIGHT:
        return int(count.parameters * _QUANTIZED_BYTES_PER_WEIGHT[weights])
    return (count.parameters + count.tied_embedding) * _DENSE_BYTES_PER_WEIGHT[weights]


def default_budget_bytes(device: str, host_cache_bytes: int, memory_free_bytes: int | None = None,
                         device_margin_bytes: int = 0) -> int:
    """memory.budget when the config leaves it out: the GPU's free memory less memory.device_margin
    (what other processes hold is not ours to plan with); on the CPU 80% of the RAM available now,
    less the warm tier (which lives in the same RAM; at most half).

    A GPU's free memory is ``memory_free_bytes``: NVML's when the workers were planned (the supervisor
    never loads torch; with engine.isolation: thread too)."""
    if device.startswith("cuda"):
        if memory_free_bytes is None:
            raise ValueError(f"{device}: the default memory budget needs the GPU's memory_free_bytes")
        return max(0, memory_free_bytes - device_margin_bytes)
    import psutil

    usable = int(psutil.virtual_memory().available * DEFAULT_CPU_BUDGET_FRACTION)
    return usable - min(host_cache_bytes, usable // 2)


@dataclass
class Resident:
    """A loaded model as the eviction plan sees it."""
    name: str
    size_bytes: int
    last_used: float
    evictable: bool  # idle (no running or queued request) and not pinned
    counted: bool = True  # counts against max_loaded_models (a LoRA adapter does not)


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
        num_models -= victim.counted
    return victims
