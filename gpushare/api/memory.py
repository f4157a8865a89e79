"""Where the daemon's memory goes: model weights, committed KV, and the runtime's overhead.

Reported by ``/api/ps`` (``memory``) and ``/metrics``. The resident set is the daemon's and its
engine workers' together. On the CPU weights and KV live in the workers' resident sets, so the
overhead is what the resident sets hold beyond weights and committed KV (the torch runtimes, the
HTTP server, allocator slack); on a GPU weights and KV are in device memory and the whole
resident set is overhead.
"""

from dataclasses import asdict, dataclass, field

import psutil


@dataclass
class MemoryReport:
    rss_bytes: int  # the daemon's and its workers'
    weight_bytes: int  # every loaded model's weights as stored
    kv_pool_bytes: int  # the engine's KV pool (memory.kv_budget)
    kv_committed_bytes: int  # the pool's slabs that models hold now
    runtime_overhead_bytes: int
    # per engine device: its memory used and free as its worker last saw it (protocol/engine_stats.py)
    devices: list[dict] = field(default_factory=list)

    def as_json(self) -> dict:
        return asdict(self)


def memory_report(ctx) -> MemoryReport:
    loaded = ctx.registry.loaded()
    weights = sum(e.weight_bytes for e in loaded)
    stats = ctx.node.stats()
    rss = psutil.Process().memory_info().rss
    for device in ctx.registry.devices.values():
        for pid in getattr(device, "pids", [device.pid]):  # a tensor-parallel group: every rank
            if pid is None:
                continue
            try:
                rss += psutil.Process(pid).memory_info().rss
            except psutil.Error:  # it just died; the supervisor restarts it
                pass
    on_host = sum(e.weight_bytes + getattr(stats.models.get(e.name), "kv_committed_bytes", 0) for e in loaded
                  if e.device.config.device == "cpu")
    devices = [{"device": name, "memory": s.memory_kind, "used_bytes": s.memory_used_bytes,
                "free_bytes": s.memory_free_bytes}
               for name, s in ((name, device.stats()) for name, device in ctx.registry.devices.items())]
    return MemoryReport(rss, weights, stats.kv_pool_bytes, stats.kv_committed_bytes, max(0, rss - on_host), devices)
