"""The daemon's life cycle: settings -> engine workers -> registry -> HTTP; systemd notifications,
SIGHUP reloads (gpushare/daemon/lifecycle.py), drain and stop on SIGINT/SIGTERM.

This process is the supervisor: HTTP, tenants, the registry, placement, the node. Engines run in
worker processes, one per device of the worker plan (engine.devices: node/devices.py), plus one
per rank of each tensor-parallel group (daemon/groups.py), started at once and restarted when
they die (residency/device_supervisor.py); the registry loads models into them on demand. Start: the workers start, HTTP listens (/health, /ready answer 503
"starting"), the configured models preload (each announced to systemd with
EXTEND_TIMEOUT_USEC), then READY=1. A watchdog thread sends WATCHDOG=1 while no running engine
is stalled. On the first SIGINT/SIGTERM: STOPPING=1, /ready and every new request answer 503,
in-flight requests get `server.drain_timeout` to finish, then the rest are cancelled (their
streams end with an error chunk), models are unloaded and the workers stop; exit 0. A second
signal skips the drain.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import importlib.util
import logging
import os
import time
from pathlib import Path

from aiohttp import web

from gpushare.api.app import build_app
from gpushare.api.context import ApiContext
from gpushare.api.health import engine_alive
from gpushare.settings.settings import ConfigError, Settings, parse_host
from gpushare.daemon.groups import group_clients, plan_groups
from gpushare.daemon.lifecycle import Reloader, Signals, engine_stall_limit_s, report_status, status_line
from gpushare.node import cpu_verdicts
from gpushare.residency.device_supervisor import DeviceSupervisor
from gpushare.residency.node_devices import NodeDevices
from gpushare.residency.registry import ModelLoadError, Registry, RegistryFull
from gpushare.residency.worker_client import WorkerClient, WorkerDied
from gpushare.service import notify
from gpushare.service.logs import setup_logging

log = logging.getLogger("gpushare.daemon")

ABORT_GRACE_S = 2.0  # after the drain, for aborted requests to write their error and close
PRELOAD_EXTEND_USEC = 300_000_000  # asked of systemd's start timeout before each preload: 5 min per model
IDLE_POLL_S = 0.05
UNLOAD_GRACE_S = 10.0  # asked of systemd's stop timeout beyond the drain: unloading, the engine thread's end


def torch_has_cuda() -> bool:
    """Whether the installed torch is a CUDA build, told from its files (a CUDA build ships
    libtorch_cuda): this process, the supervisor, never imports torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    return any(Path(folder, "lib", "libtorch_cuda.so").exists() for folder in spec.submodule_search_locations)


def check_kv_dtype(settings: Settings) -> None:
    """ConfigError when engine.kv_dtype is one a device the daemon would run on cannot store."""
    from gpushare.protocol.engine_config import kv_dtype_name

    try:
        for worker in plan_workers(settings).workers:
            kv_dtype_name(settings.engine.kv_dtype, worker.torch_device, settings.engine.weights)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def resolve_dtype(setting: str, device: str) -> str:
    if setting != "auto":
        return setting
    return "bfloat16" if device == "cuda" else "float32"


def plan_workers(settings: Settings):
    """One engine worker per device of engine.devices, with its environment and CPUs (node/devices.py)."""
    from gpushare.node.devices import plan_workers as plan
    from gpushare.node.gpu import read_gpus
    from gpushare.node.topology import read_topology

    device = settings.engine.device
    if settings.engine.devices is None and device == "auto" and not torch_has_cuda():
        device = "cpu"  # else auto: the GPUs NVML sees, or the CPU when there are none
    return plan(settings.engine.devices, read_gpus(), read_topology("/"), settings.node,
                sorted(os.sched_getaffinity(0)), device)


def check_tensor_parallel(settings: Settings) -> None:
    """ConfigError when a tensor-parallel model cannot have its group (daemon_groups.plan_groups)."""
    from gpushare.daemon.groups import plan_groups

    plan_groups(settings, plan_workers(settings))


def engine_config(settings: Settings, plan):
    """The EngineConfig of the engine worker on one device of the worker plan."""
    from gpushare.protocol.engine_config import EngineConfig

    e = settings.engine
    return EngineConfig(max_num_seqs=e.max_num_seqs, max_num_batched_tokens=e.max_num_batched_tokens,
                        block_size=e.block_size, num_threads=e.num_threads or plan.torch_threads,
                        prefix_cache=settings.prefix_cache_scope, cpus=plan.cpus, device=plan.torch_device,
                        kv_cache_bytes=settings.memory.kv_budget_bytes, kv_dtype=e.kv_dtype, weights=e.weights,
                        device_margin_bytes=settings.memory.device_margin_bytes)


def worker_clients(settings: Settings, plans) -> dict[str, WorkerClient]:
    from gpushare.protocol.messages import WorkerSpec

    return {plan.name: WorkerClient(WorkerSpec(plan.name, engine_config(settings, plan)), plan.env,
                                    settings.memory.kv_budget_bytes) for plan in plans.workers}


def thread_engine_configs(settings: Settings, plans) -> tuple[dict, str | None]:
    """engine.isolation: thread: each device's EngineConfig, on its own CUDA device index where it is a
    GPU, and the CUDA_VISIBLE_DEVICES that makes those indices the plan's GPUs (node/devices.py:
    one_process_devices). ConfigError where one process cannot address them all (MIG)."""
    from gpushare.node.devices import one_process_devices

    try:
        visible, devices = one_process_devices(plans.workers)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    configs = {}
    for plan in plans.workers:
        configs[plan.name] = engine_config(settings, plan)
        configs[plan.name].device = devices[plan.name]
    return configs, visible


def check_isolation(settings: Settings) -> None:
    """ConfigError when engine.isolation: thread cannot address the planned devices in one process."""
    if settings.engine.isolation == "thread":
        thread_engine_configs(settings, plan_workers(settings))


def engine_threads(settings: Settings, plans) -> dict:
    """engine.isolation: thread: each device's engine on a thread of this process (no isolation). The
    one place the supervisor imports the engine, by that setting's definition (tests/test_import_rule.py)."""
    configs, visible = thread_engine_configs(settings, plans)
    if visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible  # before this process first touches CUDA (the engines')
    from gpushare.engine.local_device import local_devices

    return local_devices(configs)


async def start_http(app: web.Application, settings: Settings) -> web.AppRunner:
    host, port = parse_host(settings.server.host)
    # handler_cancellation: a client that disconnects cancels its handler, hence its request.
    # shutdown_timeout: the drain (below) has already waited for the requests in flight.
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=ABORT_GRACE_S)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError:
        await runner.cleanup()
        raise
    log.info("listening on http://%s:%d", host, port)
    return runner


async def preload(ctx: ApiContext) -> None:
    models = [m for m in ctx.settings.models if m.preload or m.pinned]  # a pinned model is resident from the start
    for i, m in enumerate(models, 1):
        notify.extend_timeout(PRELOAD_EXTEND_USEC)
        notify.status(f"starting: loading {m.name} ({i}/{len(models)})")
        await ctx.registry.load(m.name)


async def start_serving(ctx: ApiContext, stop: asyncio.Event) -> bool:
    """Preload (a failure stops the daemon), then READY=1; False when a stop signal came first."""
    starting = asyncio.create_task(preload(ctx))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        starting.cancel()  # no further preloads; one already loading finishes (registry.close waits for it)
        return False
    stopping.cancel()
    starting.result()
    # What the daemon holds from here on (modules, registry, model heads) is never garbage: kept out
    # of the cyclic collector, a full collection (which a request's parsed body can set off, and
    # which holds the GIL, and so the event loop, throughout) scans only what came later: ~15 ms
    # instead of 150-250 ms (tests/test_loop_bounds.py polls through it).
    gc.freeze()
    ctx.phase = "serving"
    notify.ready(status_line(ctx, None))
    log.info("ready")
    return True


async def wait_until_idle(ctx: ApiContext, timeout_s: float, force: asyncio.Event | None = None) -> bool:
    """Wait until no request is in flight (True), `timeout_s` passed or `force` was set (False)."""
    deadline = time.monotonic() + timeout_s
    while ctx.in_flight and time.monotonic() < deadline and not (force and force.is_set()):
        await asyncio.sleep(IDLE_POLL_S)
    return ctx.in_flight == 0


async def drain(runner: web.AppRunner, ctx: ApiContext, force: asyncio.Event) -> None:
    """Refuse new requests (503), give those in flight server.drain_timeout (less if `force` is set),
    then cancel the rest through the engine, so that their streams end with an error object."""
    ctx.phase = "draining"
    notify.stopping()
    timeout_s = ctx.settings.server.drain_timeout_s
    # A drain_timeout longer than TimeoutStopSec= must not end in SIGKILL.
    notify.extend_timeout(int((timeout_s + ABORT_GRACE_S + UNLOAD_GRACE_S) * 1e6))
    notify.status(f"stopping: draining {ctx.in_flight} requests (up to {timeout_s:g}s)")
    if not await wait_until_idle(ctx, timeout_s, force):
        log.warning("drain over: cancelling %d requests still running", ctx.in_flight)
    notify.status("stopping: unloading models")
    await ctx.registry.close()  # unloading aborts what still runs
    await wait_until_idle(ctx, ABORT_GRACE_S)
    await runner.cleanup()


def return_big_buffers() -> None:
    """Request bodies (up to limits.max_body_bytes) arrive in pieces of up to 1 MiB. glibc serves such
    pieces from the heap once a freed one has raised its adaptive mmap threshold, and a fragmented
    heap keeps them resident after the request: a fixed threshold maps each and unmaps it when freed."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD, glibc's initial value
    except OSError:  # not glibc: its allocator has its own policy
        pass


async def serve(settings: Settings) -> None:
    from gpushare.node.affinity import apply_thread_affinity

    return_big_buffers()
    plans = plan_workers(settings)
    for note in plans.notes:
        log.info("pinning: %s", note)
    # HTTP, tokenisation and every thread started from here on go to the CPUs no engine has.
    apply_thread_affinity(plans.other_cpus)
    kinds = {p.torch_device for p in plans.workers}
    dtype = resolve_dtype(settings.engine.dtype, "cuda" if "cuda" in kinds else "cpu")
    log.info("engine workers on %s (%s activations, %s weights); models: %s; models_dir: %s",
             ", ".join(p.name for p in plans.workers), dtype, settings.engine.weights,
             ", ".join(m.name for m in settings.models) or "none configured", settings.models_dir)
    if "cpu" in kinds:
        for line in cpu_verdicts.describe():
            log.info("CPU kernels: %s", line)
    clients = worker_clients(settings, plans) if settings.engine.isolation == "process" else \
        engine_threads(settings, plans)
    groups, model_groups = group_clients(settings, plan_groups(settings, plans),
                                         lambda plan: engine_config(settings, plan))
    supervisor = DeviceSupervisor(clients | groups, {p.name: p.mig_uuid or p.gpu_uuid for p in plans.workers})
    await supervisor.start()
    try:
        await serve_with(settings, supervisor, plans, dtype, model_groups)
    finally:
        await supervisor.close()
        log.info("stopped")


async def serve_with(settings: Settings, supervisor: DeviceSupervisor, plans, dtype: str,
                     model_groups: dict[str, str] | None = None) -> None:
    devices = supervisor.clients
    registry = Registry(devices, settings, dtype=dtype, find_device=lambda text: plans.find(text).name,
                        memory_free_bytes=plans.memory_free_bytes())
    registry.residency.model_groups = model_groups or {}
    registry.residency.is_healthy = supervisor.healthy
    engines = NodeDevices(devices)
    watchdog_s = notify.watchdog_interval_s()
    ctx = ApiContext(engines, registry, settings, engine_stall_s=engine_stall_limit_s(watchdog_s),
                     supervisor=supervisor)
    supervisor.on_lost = registry.forget_device
    supervisor.on_back = lambda name: device_back(ctx, name)
    watchdog = notify.Watchdog(lambda: engine_alive(engines, ctx.engine_stall_s), watchdog_s)
    watchdog.start()
    reloader = Reloader(ctx)
    signals = Signals(reloader.request)
    balancing = asyncio.get_running_loop().create_task(engines.balance_forever())  # node-wide kv_limits
    try:
        runner = await start_http(build_app(ctx), settings)
        try:
            if await start_serving(ctx, signals.stop):
                reloader.started()
                await report_status(ctx, reloader, signals.stop)
        finally:
            await reloader.finish()
            await drain(runner, ctx, signals.force)
    finally:
        balancing.cancel()
        watchdog.stop()


def device_back(ctx: ApiContext, name: str) -> None:
    """A restarted worker: the live tenant policies again, then the preload and pinned models it is for."""
    ctx.node.resend(name)
    ctx.registry.device_back(name)


def run(settings: Settings) -> int:
    setup_logging("INFO")
    # The tokenizers library's batch calls run on every core by default; in this process they would take
    # the cores the engine's workers compute on (a large request's inputs go in their idle time instead:
    # api/idle_work.py).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        asyncio.run(serve(settings))
    except OSError as e:  # the port is taken, typically
        log.error("cannot serve on %s: %s", settings.server.host, e.strerror or e)
        notify.status(f"failed: cannot serve on {settings.server.host}: {e.strerror or e}")
        return 1
    except WorkerDied as e:  # an engine worker could not start
        log.error("%s", e)
        notify.status(f"failed: {e}")
        return 1
    except (ModelLoadError, RegistryFull) as e:  # a preload failed
        log.error("%s", e)
        notify.status(f"failed: {e}")
        return 1
    return 0
