"""The model-server metrics a Gateway API Inference Extension endpoint picker reads, named as vLLM
names them, one series per loaded model (label ``model_name``): requests waiting in the engine and
running in its batches, the KV cache use as a 0-1 fraction of the model's pool, and the pool's
shape (``vllm:cache_config_info``, value 1, labels ``block_size`` and ``num_gpu_blocks``).

They are part of /metrics, beside gpushare's own names, and alone at /metrics/gateway: the picker
cannot send an API key, so with ``server.open_gateway_metrics`` that path answers without one. It
names no tenant, only the models and their load.
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gpushare.api.context import ApiContext, context
from gpushare.api.tenants import GATEWAY_METRICS_PATH, check_admin


class GatewayCollector:
    """The vllm:* gauges, read from `Engine.stats()` at scrape time."""

    def __init__(self, ctx: ApiContext):
        self.ctx = ctx

    def collect(self):
        def gauge(name, doc, extra_labels=()):
            return GaugeMetricFamily(name, doc, labels=["model_name", *extra_labels])

        waiting = gauge("vllm:num_requests_waiting", "Requests waiting in the engine for a place in a batch")
        running = gauge("vllm:num_requests_running", "Requests running in the engine's batches")
        usage = gauge("vllm:kv_cache_usage_perc", "KV cache blocks held by requests, a fraction of the model's "
                      "pool (1 = full)")
        config = gauge("vllm:cache_config_info", "The model's KV cache pool: tokens per block, blocks",
                       ("block_size", "num_gpu_blocks"))
        for name, m in self.ctx.node.stats().models.items():
            waiting.add_metric([name], m.waiting)
            running.add_metric([name], m.running)
            usage.add_metric([name], m.blocks_used / m.blocks_total if m.blocks_total else 0.0)
            config.add_metric([name, str(m.block_size), str(m.blocks_total)], 1)
        return [waiting, running, usage, config]


GATEWAY_REGISTRY = web.AppKey("gpushare.gateway_metrics", CollectorRegistry)


async def gateway_metrics(request: web.Request) -> web.Response:
    if not context(request).settings.server.open_gateway_metrics:
        check_admin(request, f"read {GATEWAY_METRICS_PATH} (server.open_gateway_metrics is off)")
    body = await asyncio.to_thread(generate_latest, request.app[GATEWAY_REGISTRY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def setup(app: web.Application, ctx: ApiContext) -> GatewayCollector:
    """Route /metrics/gateway; returns the collector for /metrics to include as well."""
    collector = GatewayCollector(ctx)
    registry = CollectorRegistry()
    registry.register(collector)
    app[GATEWAY_REGISTRY] = registry
    app.router.add_get(GATEWAY_METRICS_PATH, gateway_metrics)
    return collector
