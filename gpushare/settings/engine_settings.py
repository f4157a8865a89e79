"""The `engine:` section of the daemon's settings: activations, weight format, devices, isolation and
batch sizes (every key documented in configs/reference.yaml)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from gpushare.protocol.engine_config import KV_DTYPES
from gpushare.settings.values import ConfigError, choice, described, expect_mapping, positive_int, reject_unknown

DTYPES = ("auto", "float32", "float16", "bfloat16")
WEIGHTS = ("auto", "int8", "int4", "bfloat16", "float16", "float32")  # as gpushare.protocol.weight_format
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class EngineSettings:
    dtype: str = "auto"  # activations; auto: bfloat16 on CUDA, float32 on CPU
    weights: str = "auto"  # weight format; auto: int4 for 4-bit files, int8 for other quantized ones (weight_format.py)
    device: str = "auto"  # auto: cuda when torch is a CUDA build and NVML sees a GPU, else cpu (devices=None only)
    devices: list[str] | None = None  # engine workers: cuda:N, GPU-/MIG- uuids, cpu, cpu:LIST; None: auto
    isolation: str = "process"  # each device's engine in a worker process | "thread": in the daemon
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_threads: int | None = None  # torch threads for the engine; None: torch's choice
    kv_dtype: str = "auto"  # KV cache storage; auto: bfloat16, float32 for float32 weights on CPU (engine_config.kv_dtype_name)


def read_engine(raw: Any) -> EngineSettings:
    """The `engine:` section alone (gpushare node plan reads its devices)."""
    d = expect_mapping(raw, "engine")
    reject_unknown(d, {f.name for f in dataclasses.fields(EngineSettings)}, "engine.")
    e = EngineSettings()
    if "dtype" in d:
        e.dtype = choice(d["dtype"], DTYPES, "engine.dtype")
    if "weights" in d:
        e.weights = choice(d["weights"], WEIGHTS, "engine.weights")
    if "device" in d:
        e.device = choice(d["device"], DEVICES, "engine.device")
    if "devices" in d:
        e.devices = read_devices(d["devices"])
    if "isolation" in d:
        e.isolation = choice(d["isolation"], ("process", "thread"), "engine.isolation")
    if "kv_dtype" in d:
        e.kv_dtype = choice(d["kv_dtype"], KV_DTYPES, "engine.kv_dtype")
        if e.kv_dtype == "float16" and e.device == "cpu":
            raise ConfigError("engine.kv_dtype: float16 is for GPUs; with engine.device cpu use bfloat16, int8 or float32")
        if e.kv_dtype == "int8" and e.device == "cuda":
            raise ConfigError("engine.kv_dtype: int8 runs on the CPU only; with engine.device cuda use bfloat16, "
                              "float16 or float32")
    for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_threads"):
        if d.get(name) is not None:
            setattr(e, name, positive_int(d[name], f"engine.{name}"))
    return e


def read_devices(raw: Any) -> list[str] | None:
    from gpushare.node.devices import parse_device

    if raw == "auto":
        return None
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"engine.devices: must be auto or a non-empty list of devices, got {described(raw)}")
    taken: dict[int, str] = {}  # CPU -> the cpu:LIST entry holding it
    for i, text in enumerate(raw):
        key = f"engine.devices[{i}]"
        try:
            entry = parse_device(text)
        except ValueError as e:
            raise ConfigError(f"{key}: {e}") from None
        if text in raw[:i]:
            raise ConfigError(f"{key}: {text!r} is listed twice")
        for cpu in entry.cpus or ():
            if cpu in taken:
                raise ConfigError(f"{key}: CPU {cpu} is in {taken[cpu]} too; two workers cannot own one CPU")
            taken[cpu] = text
    return list(raw)
