"""The tensor-parallel keys of one `models[]` entry: tensor_parallel, tensor_parallel_devices,
tensor_parallel_cross_numa (see configs/reference.yaml; gpushare/node/tp_groups.py plans the group).

Checked here: types, that the devices are entries of engine.devices (when it is a list), of one
kind, without duplicates and as many as tensor_parallel; that the model is neither pinned to one
`device` nor replicated. Whether the node's links allow the group is the planner's business.
"""

from __future__ import annotations

from typing import Any

from gpushare.settings.values import ConfigError

_KIND_OF_ENTRY = {"cuda": "a GPU", "gpu": "a GPU", "mig": "a MIG instance", "cpu": "a CPU"}


def read_tensor_parallel(d: dict, key: str, engine_devices: list[str] | None) -> dict[str, Any]:
    """-> ModelEntry keyword arguments. With tensor_parallel_devices and no tensor_parallel,
    tensor_parallel is the number of devices listed."""
    devices = _devices(d.get("tensor_parallel_devices"), key, engine_devices)
    size = d.get("tensor_parallel", len(devices) if devices else 1)
    if size != "auto" and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ConfigError(f"{key}.tensor_parallel: must be a positive integer or auto, got {size!r}")
    if devices and size != "auto" and size != len(devices):
        raise ConfigError(f"{key}.tensor_parallel_devices: names {len(devices)} devices, and tensor_parallel is {size}")
    if isinstance(size, int) and engine_devices is not None and size > len(engine_devices):
        raise ConfigError(f"{key}.tensor_parallel: {size} needs {size} devices, and engine.devices names "
                          f"{len(engine_devices)}")
    if size != 1:
        for other, conflict in (("device", d.get("device") is not None), ("replicas", d.get("replicas", 1) != 1)):
            if conflict:
                raise ConfigError(f"{key}.{other}: a tensor-parallel model (tensor_parallel {size}) is one group; "
                                  "use tensor_parallel_devices to name its devices")
    cross_numa = d.get("tensor_parallel_cross_numa", False)
    if not isinstance(cross_numa, bool):
        raise ConfigError(f"{key}.tensor_parallel_cross_numa: must be true or false, got {cross_numa!r}")
    return {"tensor_parallel": size, "tensor_parallel_devices": devices, "tensor_parallel_cross_numa": cross_numa}


def _devices(raw: Any, key: str, engine_devices: list[str] | None) -> list[str] | None:
    from gpushare.node.devices import parse_device

    if raw is None:
        return None
    key = f"{key}.tensor_parallel_devices"
    if not isinstance(raw, list) or len(raw) < 2:
        raise ConfigError(f"{key}: must be a list of two or more engine.devices entries (one device is "
                          f"models[].device), got {raw!r}")
    kinds = set()
    for i, text in enumerate(raw):
        try:
            kinds.add(_KIND_OF_ENTRY[parse_device(text).kind])
        except ValueError as e:
            raise ConfigError(f"{key}[{i}]: {e}") from None
        if engine_devices is not None and text not in engine_devices:
            raise ConfigError(f"{key}[{i}]: {text!r} is not one of engine.devices ({', '.join(engine_devices)})")
        if text in raw[:i]:
            raise ConfigError(f"{key}[{i}]: {text!r} is listed twice")
    if len(kinds) > 1:
        raise ConfigError(f"{key}: {' and '.join(sorted(kinds))} never form one group; name devices of one kind")
    return list(raw)
