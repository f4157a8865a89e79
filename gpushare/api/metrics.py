"""Prometheus metrics at /metrics, from one CollectorRegistry per app (never the global one).

The vLLM-named per-model gauges a gateway's endpoint picker reads come from
api/gateway_metrics.py, here and alone at /metrics/gateway.

Counted per request, labelled by model and tenant: requests by outcome, prompt, generated
and prefix-cache-hit tokens, time to first token, inter-token latency, the whole request's time
(arrival to its last output) and its queue time (arrival to the engine's first batch with its
prompt: the tenant's queue, a model load and the engine's waiting queue). Read at scrape
time: the work pool's running and queued jobs and the body bytes it holds; the engine's queue
depth, running sequences, KV blocks (used, free, cached, reserved)
and preemptions per model; KV use, reservation and limit per tenant; the models loaded;
GPU memory and utilisation through NVML where a driver is present. Model loads (with their
durations) and unloads are seen by sampling the registry every second and at each scrape (a
model loaded and unloaded again between two samples goes unseen; loads take seconds).

A request's figures are gathered by a RequestRecord that `metrics_middleware` opens for each
inference request; EngineStream, created deep inside the dialect's handler but in the same
task, finds it through a context variable and feeds it every output.

Outcomes: ok; invalid (4xx); rejected (429, or 503 before generating: queue full,
draining); aborted (the daemon cancelled it: model unloaded, drain over); error (5xx, a
failed engine step); cancelled (the client left).
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from dataclasses import dataclass, field
from typing import Callable

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gpushare.api import gateway_metrics, work
from gpushare.api.context import ApiContext, context
from gpushare.api.fields import JSON_BODY
from gpushare.api.memory import memory_report
from gpushare.api.status_history import HISTORY
from gpushare.api.tenants import INFERENCE_PATHS, TENANT, check_admin
from gpushare.residency.registry import ModelNotFound
from gpushare.protocol.outputs import RequestOutput
from gpushare.node.gpu import read_gpus as read_nvml_gpus

TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
REQUEST_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
QUEUE_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
LOAD_BUCKETS_S = (0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
REGISTRY_SAMPLE_S = 1.0

current_record: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar(
    "gpushare_request_record", default=None)


@dataclass
class RequestRecord:
    """What one inference request did, as its engine outputs arrive (all on the event loop)."""
    start_s: float = field(default_factory=time.monotonic)
    model: str = ""
    tenant: str = ""
    outputs: int = 0
    finish_reason: str | None = None
    first_token_s: float | None = None  # the engine's monotonic stamp of the first token
    last_token_s: float | None = None
    inter_token_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    generated_by_answer: dict = field(default_factory=dict)
    cached_tokens: int = 0
    scheduled_s: float | None = None  # the engine's monotonic stamp of its prompt's first batch
    end_s: float | None = None  # when its last output came
    on_first_token: Callable[[float], None] | None = None  # given the time to first token, once

    def observe(self, out: RequestOutput) -> None:
        now = time.monotonic()
        self.outputs += 1
        if out.token_ids:
            if self.last_token_s is not None:
                gap_s = (now - self.last_token_s) / len(out.token_ids)
                self.inter_token_s.extend([gap_s] * len(out.token_ids))
            self.last_token_s = now
        if self.first_token_s is None and out.first_token_time_s is not None:
            self.first_token_s = out.first_token_time_s
            if self.on_first_token is not None:
                self.on_first_token(max(0.0, self.first_token_s - self.start_s))
        if self.scheduled_s is None:
            self.scheduled_s = out.scheduled_time_s
        self.prompt_tokens = out.num_prompt_tokens or self.prompt_tokens
        self.generated_by_answer[out.index] = out.num_generated_tokens  # n > 1: every answer counts
        self.generated_tokens = sum(self.generated_by_answer.values())
        self.cached_tokens = out.num_cached_tokens or self.cached_tokens
        if out.finished:
            self.finish_reason = out.finish_reason
            self.end_s = now

    def outcome(self, status: int | None) -> str:
        """`status`: the HTTP status answered, None when the handler was cancelled (client gone)."""
        if status is None:
            return "cancelled"
        if self.finish_reason in ("stop", "length"):
            return "ok"
        if self.finish_reason in ("abort", "error"):
            return "aborted" if self.finish_reason == "abort" else "error"
        if self.outputs:  # generation began and never finished here: the client left mid-stream
            return "cancelled"
        if status < 400:
            return "ok"
        if status in (429, 503):
            return "rejected"
        return "invalid" if status < 500 else "error"


class Metrics:
    """The per-app registry with the request-side series; `StateCollector` adds the scrape-time ones."""

    def __init__(self, ctx: ApiContext):
        self.registry = CollectorRegistry()
        labels = ["model", "tenant"]
        self.requests = Counter("gpushare_requests", "Inference requests by how they ended",
                                labels + ["outcome"], registry=self.registry)
        self.prompt_tokens = Counter("gpushare_prompt_tokens", "Prompt tokens of generation requests",
                                     labels, registry=self.registry)
        self.generated_tokens = Counter("gpushare_generated_tokens", "Tokens generated", labels,
                                        registry=self.registry)
        self.prefix_hit_tokens = Counter("gpushare_prefix_cache_hit_tokens",
                                         "Prompt tokens served from the prefix cache", labels, registry=self.registry)
        self.ttft = Histogram("gpushare_time_to_first_token_seconds",
                              "From the request's arrival to its first generated token", labels,
                              buckets=TTFT_BUCKETS_S, registry=self.registry)
        self.itl = Histogram("gpushare_inter_token_latency_seconds", "Between consecutive generated tokens",
                             labels, buckets=ITL_BUCKETS_S, registry=self.registry)
        self.request_time = Histogram("gpushare_request_duration_seconds", "A generation request that ended "
                                      "well, from its arrival to its last output (end to end)", labels,
                                      buckets=REQUEST_BUCKETS_S, registry=self.registry)
        self.queue_time = Histogram("gpushare_request_queue_time_seconds", "From a request's arrival to the "
                                    "engine's first batch with its prompt (tenant queue, model load, engine queue)",
                                    labels, buckets=QUEUE_BUCKETS_S, registry=self.registry)
        self.loads = Counter("gpushare_model_loads", "Models loaded", ["model"], registry=self.registry)
        self.load_duration = Histogram("gpushare_model_load_duration_seconds", "Time to load a model",
                                       ["model"], buckets=LOAD_BUCKETS_S, registry=self.registry)
        self.unloads = Counter("gpushare_model_unloads", "Models unloaded (keep_alive expired, evicted to make "
                               "room, or asked for)", ["model"], registry=self.registry)
        self.registry.register(StateCollector(ctx))
        self._ctx = ctx
        self._loaded: dict[str, int] = {}  # model -> id() of the LoadedEntry seen last sample

    def observe_request(self, record: RequestRecord, outcome: str) -> None:
        labels = (record.model, record.tenant)
        self.requests.labels(*labels, outcome).inc()
        self.prompt_tokens.labels(*labels).inc(record.prompt_tokens)
        self.generated_tokens.labels(*labels).inc(record.generated_tokens)
        self.prefix_hit_tokens.labels(*labels).inc(record.cached_tokens)
        if record.first_token_s is not None:
            self.ttft.labels(*labels).observe(max(0.0, record.first_token_s - record.start_s))
        itl = self.itl.labels(*labels)
        for gap_s in record.inter_token_s:
            itl.observe(gap_s)
        if record.scheduled_s is not None:
            self.queue_time.labels(*labels).observe(max(0.0, record.scheduled_s - record.start_s))
        if record.end_s is not None and outcome == "ok":
            self.request_time.labels(*labels).observe(record.end_s - record.start_s)

    def sample_registry(self) -> None:
        """Count loads and unloads since the last sample (a LoadedEntry is one load of a model)."""
        now = {e.name: e for e in self._ctx.registry.loaded()}
        for name, entry in now.items():
            if self._loaded.get(name) != id(entry):
                if name in self._loaded:
                    self.unloads.labels(name).inc()
                self.loads.labels(name).inc()
                self.load_duration.labels(name).observe(entry.load_duration_s)
        for name in self._loaded.keys() - now.keys():
            self.unloads.labels(name).inc()
        self._loaded = {name: id(entry) for name, entry in now.items()}


class StateCollector:
    """Gauges read at scrape time from the engine, the registry, the API context and NVML."""

    def __init__(self, ctx: ApiContext):
        self.ctx = ctx

    def collect(self):
        yield from self._engine_families()
        yield from self._tenant_families()
        yield GaugeMetricFamily("gpushare_models_loaded", "Models loaded now", value=len(self.ctx.registry.loaded()))
        yield GaugeMetricFamily("gpushare_http_requests_in_flight", "API requests being handled",
                                value=self.ctx.in_flight)
        queue = work.work_queue()
        yield GaugeMetricFamily("gpushare_work_running", "Preparation jobs (parse, template, tokenise) running in "
                                "the work pool", value=queue.running)
        yield GaugeMetricFamily("gpushare_work_queued", "Preparation jobs waiting for a thread of the work pool "
                                "(at most server.max_queued)", value=queue.queued)
        yield GaugeMetricFamily("gpushare_body_bytes_held", "Request body bytes read and not yet parsed (at most "
                                "server.max_body_bytes_held)", value=work.body_bytes.held)
        yield GaugeMetricFamily("gpushare_engine_last_tick_age_seconds", "Since the engine loop last turned",
                                value=max(0.0, time.monotonic() - self.ctx.node.last_tick_s))
        yield from self._gpu_families()
        yield from self._memory_families()
        yield from self._device_families()

    def _device_families(self):
        """One series per engine worker (engine.devices): health, restarts, its loop's last turn."""
        supervisor = self.ctx.supervisor
        if supervisor is None:
            return
        healthy = GaugeMetricFamily("gpushare_device_healthy", "1 while the device's engine worker runs and "
                                    "its GPU is healthy, 0 while it restarts or NVML reports faults",
                                    labels=["device"])
        restarts = CounterMetricFamily("gpushare_device_worker_restarts", "Times the device's engine worker was "
                                       "started again after it died", labels=["device"])
        tick_age = GaugeMetricFamily("gpushare_device_engine_last_tick_age_seconds", "Since the device's engine "
                                     "loop last turned (from its latest snapshot)", labels=["device"])
        models = GaugeMetricFamily("gpushare_device_models_loaded", "Models loaded on the device",
                                   labels=["device"])
        now_s = time.monotonic()
        for name, client in supervisor.clients.items():
            healthy.add_metric([name], 1 if supervisor.healthy(name) and client.alive() else 0)
            restarts.add_metric([name], supervisor.status[name].restarts)
            tick_age.add_metric([name], max(0.0, now_s - client.last_tick_s))
            models.add_metric([name], sum(1 for e in self.ctx.registry.loaded() if e.device_name == name))
        yield from (healthy, restarts, tick_age, models)

    def _memory_families(self):
        report = memory_report(self.ctx)
        for name, doc, value in (
                ("gpushare_memory_rss_bytes", "The daemon's and its engine workers' resident sets", report.rss_bytes),
                ("gpushare_memory_weights_bytes", "Weights of every loaded model, as stored", report.weight_bytes),
                ("gpushare_kv_pool_bytes", "The engines' KV pools (memory.kv_budget each)", report.kv_pool_bytes),
                ("gpushare_kv_pool_committed_bytes", "KV pool slabs held by models", report.kv_committed_bytes),
                ("gpushare_memory_runtime_overhead_bytes", "Resident memory beyond weights and committed KV "
                 "(runtime, server, allocator slack)", report.runtime_overhead_bytes)):
            yield GaugeMetricFamily(name, doc, value=value)

    def _engine_families(self):
        def gauge(name, doc):
            return GaugeMetricFamily(name, doc, labels=["model"])

        queue = gauge("gpushare_queue_depth", "Requests waiting in the engine")
        running = gauge("gpushare_running_sequences", "Sequences running in the engine")
        total = gauge("gpushare_kv_blocks_total", "KV cache blocks the model could hold with the whole device pool")
        used = gauge("gpushare_kv_blocks_used", "KV cache blocks held by sequences")
        free = gauge("gpushare_kv_blocks_free", "KV cache blocks free (cached blocks nobody holds included)")
        cached = gauge("gpushare_kv_blocks_cached", "KV cache blocks kept for prefix reuse")
        reserved = gauge("gpushare_kv_blocks_reserved", "KV cache blocks set aside for tenants' reservations")
        preemptions = CounterMetricFamily("gpushare_preemptions", "Sequences preempted (blocks freed, recomputed "
                                          "later)", labels=["model"])
        steps = CounterMetricFamily("gpushare_engine_steps", "Engine steps run", labels=["model"])
        kv_bytes = gauge("gpushare_kv_committed_bytes", "Bytes of the KV pool's slabs the model holds")
        for name, m in self.ctx.node.stats().models.items():
            queue.add_metric([name], m.waiting)
            running.add_metric([name], m.running)
            total.add_metric([name], m.blocks_total)
            used.add_metric([name], m.blocks_used)
            free.add_metric([name], m.blocks_total - m.blocks_used)
            cached.add_metric([name], getattr(m, "cached_blocks", 0))
            reserved.add_metric([name], getattr(m, "blocks_reserved", 0))
            preemptions.add_metric([name], m.preemptions)
            steps.add_metric([name], m.steps)
            kv_bytes.add_metric([name], m.kv_committed_bytes)
        return [queue, running, total, used, free, cached, reserved, preemptions, steps, kv_bytes]

    def _tenant_families(self):
        used = GaugeMetricFamily("gpushare_tenant_kv_used_bytes", "KV cache bytes a tenant holds, all models",
                                 labels=["tenant"])
        reserved = GaugeMetricFamily("gpushare_tenant_kv_reserved_bytes", "A tenant's guaranteed KV bytes",
                                     labels=["tenant"])
        limit = GaugeMetricFamily("gpushare_tenant_kv_limit_bytes", "A tenant's KV ceiling (absent: none)",
                                  labels=["tenant"])
        running = GaugeMetricFamily("gpushare_tenant_running_sequences", "A tenant's sequences running",
                                    labels=["tenant"])
        queue = GaugeMetricFamily("gpushare_tenant_queue_depth", "A tenant's requests waiting in the engine",
                                  labels=["tenant"])
        for name, t in self.ctx.node.tenant_stats().items():
            used.add_metric([name], t.kv_used_bytes)
            reserved.add_metric([name], t.kv_reserved_bytes)
            if t.kv_limit_bytes is not None:
                limit.add_metric([name], t.kv_limit_bytes)
            running.add_metric([name], t.running)
            queue.add_metric([name], t.waiting)
        return [used, reserved, limit, running, queue]

    def _gpu_families(self):
        report = read_nvml_gpus()
        if not report.available:
            return []
        labels = ["gpu", "uuid"]
        total = GaugeMetricFamily("gpushare_gpu_memory_total_bytes", "GPU memory", labels=labels)
        used = GaugeMetricFamily("gpushare_gpu_memory_used_bytes", "GPU memory in use (all processes)",
                                 labels=labels)
        util = GaugeMetricFamily("gpushare_gpu_utilization_percent", "GPU busy time over NVML's last sample "
                                 "period (absent under MIG)", labels=labels)
        for gpu in report.gpus:
            key = [str(gpu.index), gpu.uuid]
            total.add_metric(key, gpu.memory_total_bytes)
            used.add_metric(key, gpu.memory_used_bytes)
            if gpu.utilization_percent is not None:
                util.add_metric(key, gpu.utilization_percent)
        return [total, used, util]


METRICS = web.AppKey("gpushare.metrics", Metrics)


def _model_named_in_body(request: web.Request, ctx: ApiContext) -> str:
    """The known model the request body names, for requests refused before reaching one ("" if none).
    Only a body the handler already parsed is looked at: a request refused before (401, 403, 415) is
    not worth parsing up to 64 MiB for a label. Only names the registry knows become labels:
    arbitrary client strings would grow the series."""
    name = request.get(JSON_BODY, {}).get("model")
    try:
        return ctx.registry.find(name).name if isinstance(name, str) else ""
    except ModelNotFound:
        return ""


@web.middleware
async def metrics_middleware(request: web.Request, handler):
    """Opens a RequestRecord for each inference request and counts it by outcome when it ends."""
    if request.method != "POST" or request.path not in INFERENCE_PATHS:
        return await handler(request)
    history = request.app[HISTORY]
    record = RequestRecord(on_first_token=history.observe_ttft)
    token = current_record.set(record)
    status = None
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as e:  # raised as a response (aiohttp's own redirects and errors)
        status = e.status
        raise
    finally:
        current_record.reset(token)
        tenant = request.get(TENANT)
        record.tenant = record.tenant or (tenant.name if tenant is not None else "")
        if not record.model and status is not None:
            record.model = _model_named_in_body(request, context(request))
        if status == 429:
            history.count_rejection(record.tenant)
        request.app[METRICS].observe_request(record, record.outcome(status))


def record_for_stream(model: str, tenant: str) -> RequestRecord | None:
    """The current request's record, now naming the model and tenant it generates for (None outside one)."""
    record = current_record.get()
    if record is not None:
        record.model, record.tenant = model, tenant
    return record


async def metrics(request: web.Request) -> web.Response:
    check_admin(request, "read /metrics (it shows every tenant's traffic)")
    m = request.app[METRICS]
    m.sample_registry()
    # In a worker thread: NVML calls can take tens of milliseconds.
    body = await asyncio.to_thread(generate_latest, m.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _sample_registry_every_second(app: web.Application):
    async def loop():
        while True:
            await asyncio.sleep(REGISTRY_SAMPLE_S)
            app[METRICS].sample_registry()

    task = asyncio.create_task(loop())
    yield
    task.cancel()


def setup(app: web.Application, ctx: ApiContext) -> None:
    """Route /metrics and sample the registry while the app runs (build_app lists `metrics_middleware`)."""
    app[METRICS] = Metrics(ctx)
    app[METRICS].registry.register(gateway_metrics.setup(app, ctx))
    app.router.add_get("/metrics", metrics)
    app.cleanup_ctx.append(_sample_registry_every_second)
