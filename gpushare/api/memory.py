"""Where the daemon's memory goes: model weights, committed KV, and the runtime's overhead.

Reported by ``/api/ps`` (``memory``) and ``/metrics``. On the CPU everything is in the process's
resident set, so the overhead is what the resident set holds beyond weights and committed KV
(the torch runtime, the HTTP server, allocator slack); on a GPU weights and KV are in device
memory and the whole resident set is overhead.
"""

from dataclasses import asdict, dataclass

import psutil


@dataclass
class MemoryReport:
    rss_bytes: int
    weight_bytes: int  # every loaded model's weights as stored
    kv_pool_bytes: int  # the engine's KV pool (memory.kv_budget)
    kv_committed_bytes: int  # the pool's slabs that models hold now
    runtime_overhead_bytes: int

    def as_json(self) -> dict:
        return asdict(self)


def memory_report(ctx) -> MemoryReport:
    weights = sum(e.weight_bytes for e in ctx.registry.loaded())
    stats = ctx.engine.stats()
    rss = psutil.Process().memory_info().rss
    on_host = 0 if ctx.registry.device.startswith("cuda") else weights + stats.kv_committed_bytes
    return MemoryReport(rss, weights, stats.kv_pool_bytes, stats.kv_committed_bytes, max(0, rss - on_host))
