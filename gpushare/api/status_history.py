"""The last five minutes of the node, one sample a second, for the status page's charts (api/status.py).

A background task samples the merged engine stats every second: tokens generated per second (node
and per model copy, from the engines' cumulative counters), requests queued and running in the
engines, and the KV blocks held by sequences as a fraction of the KV pools. Times to first token
are fed in as they happen (`observe_ttft`, from the request's RequestRecord in api/metrics.py); each
sample carries the p50 and p99 of those seen in the last TTFT_WINDOW_S (none: null). 429 answers are
counted per tenant (`count_rejection`) and kept for a minute.

Everything runs on the event loop; a sample reads the engines' latest snapshots and touches no device.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import asdict, dataclass

from aiohttp import web

SAMPLE_INTERVAL_S = 1.0
HISTORY_SAMPLES = 300  # five minutes
TTFT_WINDOW_S = 10.0
REJECTION_WINDOW_S = 60.0


@dataclass
class Sample:
    t: float  # wall-clock epoch seconds
    tokens_per_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    queued: int
    running: int
    kv_used_fraction: float  # blocks held by sequences, of every device's KV pool

    def as_json(self) -> dict:
        return asdict(self)


def percentile(sorted_values: list[float], q: float) -> float | None:
    """The nearest-rank q-th percentile (0-100) of an ascending list; None for an empty one."""
    if not sorted_values:
        return None
    rank = max(1, -(-len(sorted_values) * q // 100))  # ceil(n * q / 100)
    return sorted_values[int(rank) - 1]


class History:
    def __init__(self, ctx):
        self.ctx = ctx
        self.samples: deque[Sample] = deque(maxlen=HISTORY_SAMPLES)
        self.model_tokens_per_s: dict[tuple[str, str], float] = {}  # (device, model) -> latest rate
        self._ttfts: deque[tuple[float, float]] = deque()  # (monotonic stamp, seconds)
        self._rejections: dict[str, deque[float]] = {}  # tenant -> monotonic stamps of its 429s
        self._generated: dict[tuple[str, str], int] = {}
        self._last_s: float | None = None

    def observe_ttft(self, ttft_s: float) -> None:
        self._ttfts.append((time.monotonic(), ttft_s))

    def count_rejection(self, tenant: str) -> None:
        self._rejections.setdefault(tenant, deque()).append(time.monotonic())

    def rejections_last_minute(self, tenant: str) -> int:
        stamps = self._rejections.get(tenant)
        if not stamps:
            return 0
        cutoff = time.monotonic() - REJECTION_WINDOW_S
        while stamps and stamps[0] < cutoff:
            stamps.popleft()
        return len(stamps)

    def since(self, t: float) -> list[dict]:
        return [s.as_json() for s in self.samples if s.t > t]

    def sample(self) -> Sample:
        now_s = time.monotonic()
        elapsed_s = now_s - self._last_s if self._last_s is not None else 0.0
        self._last_s = now_s
        generated, rates = {}, {}
        queued = running = used_bytes = pool_bytes = 0
        for device, engine in self.ctx.registry.devices.items():
            stats = engine.stats()
            pool_bytes += stats.kv_pool_bytes
            for name, m in stats.models.items():
                key = (device, name)
                generated[key] = m.generated_tokens
                before = self._generated.get(key, m.generated_tokens)
                new_tokens = m.generated_tokens - before if m.generated_tokens >= before else m.generated_tokens
                rates[key] = new_tokens / elapsed_s if elapsed_s > 0 else 0.0
                queued, running = queued + m.waiting, running + m.running
                used_bytes += m.blocks_used * m.block_bytes
        self._generated, self.model_tokens_per_s = generated, rates
        while self._ttfts and self._ttfts[0][0] < now_s - TTFT_WINDOW_S:
            self._ttfts.popleft()
        ttfts = sorted(v for _, v in self._ttfts)
        sample = Sample(time.time(), round(sum(rates.values()), 3), percentile(ttfts, 50), percentile(ttfts, 99),
                        queued, running, round(used_bytes / pool_bytes, 6) if pool_bytes else 0.0)
        self.samples.append(sample)
        return sample


HISTORY = web.AppKey("gpushare.status_history", History)


async def _sample_every_second(app: web.Application):
    async def loop():
        while True:
            app[HISTORY].sample()
            await asyncio.sleep(SAMPLE_INTERVAL_S)

    task = asyncio.create_task(loop())
    yield
    task.cancel()


def setup(app: web.Application, ctx) -> History:
    app[HISTORY] = History(ctx)
    app.cleanup_ctx.append(_sample_every_second)
    return app[HISTORY]
