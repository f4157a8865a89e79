"""The daemon's life cycle: settings -> engine -> registry -> HTTP; drain and stop on SIGINT/SIGTERM.

One Engine, started once, serves every model; the registry loads models into it on
demand. On the first SIGINT/SIGTERM the listening socket closes, in-flight requests get
`server.drain_timeout` to finish (then are cancelled), models are unloaded and the
engine thread stops; a second signal skips the drain.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from aiohttp import web

from gpushare.api.app import build_app
from gpushare.api.context import ApiContext
from gpushare.config import Settings, parse_host
from gpushare.engine.registry import ModelLoadError, Registry, RegistryFull

log = logging.getLogger("gpushare.daemon")

ABORT_GRACE_S = 2.0  # after the drain, for aborted requests to write their error and close


def resolve_device(setting: str) -> str:
    if setting != "auto":
        return setting
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(setting: str, device: str) -> str:
    if setting != "auto":
        return setting
    return "bfloat16" if device == "cuda" else "float32"


def start_engine(settings: Settings):
    from gpushare.engine.engine import Engine, EngineConfig

    e = settings.engine
    engine = Engine(EngineConfig(max_num_seqs=e.max_num_seqs, max_num_batched_tokens=e.max_num_batched_tokens,
                                 block_size=e.block_size, num_threads=e.num_threads))
    engine.start()
    return engine


async def start_http(app: web.Application, settings: Settings) -> web.AppRunner:
    host, port = parse_host(settings.server.host)
    # handler_cancellation: a client that disconnects cancels its handler, hence its request.
    runner = web.AppRunner(app, handler_cancellation=True,
                           shutdown_timeout=settings.server.drain_timeout_s + ABORT_GRACE_S)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError:
        await runner.cleanup()
        raise
    log.info("listening on http://%s:%d", host, port)
    return runner


async def preload(registry: Registry, settings: Settings) -> None:
    for m in settings.models:
        if m.preload:
            await registry.load(m.name)


async def wait_for_stop(startup, stop: asyncio.Event) -> None:
    """Run `startup` (model preloads; its failure stops the daemon) until done, then wait for `stop`;
    a stop signal during startup is honoured at once."""
    starting = asyncio.create_task(startup)
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if starting.done():
        starting.result()
    await stopping
    starting.cancel()  # no further preloads; one already loading finishes (registry.close waits for it)


class StopSignals:
    """SIGINT/SIGTERM: the first sets `stop` (drain), the second sets `force` (cut the drain short)."""

    def __init__(self) -> None:
        self.stop = asyncio.Event()
        self.force = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self._on_signal, signum)

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.stop.is_set():
            log.warning("%s again: cancelling the requests still running", name)
            self.force.set()
        else:
            log.info("%s: draining requests and stopping (send it again to skip the drain)", name)
            self.stop.set()


async def drain(runner: web.AppRunner, registry: Registry, drain_timeout_s: float, force: asyncio.Event) -> None:
    """Stop listening; give in-flight requests drain_timeout_s (less if `force` is set), then cancel
    the rest through the engine, so that their streams end with an error object rather than a cut."""
    cleanup = asyncio.create_task(runner.cleanup())
    forced = asyncio.create_task(force.wait())
    await asyncio.wait({cleanup, forced}, timeout=drain_timeout_s, return_when=asyncio.FIRST_COMPLETED)
    forced.cancel()
    await registry.close()  # unloading aborts what still runs
    await asyncio.wait({cleanup}, timeout=ABORT_GRACE_S)


async def serve(settings: Settings) -> None:
    device = resolve_device(settings.engine.device)
    dtype = resolve_dtype(settings.engine.dtype, device)
    log.info("engine on %s (%s); models: %s; models_dir: %s", device, dtype,
             ", ".join(m.name for m in settings.models) or "none configured", settings.models_dir)
    engine = start_engine(settings)
    registry = Registry(engine, settings, device=device, dtype=dtype)
    signals = StopSignals()
    try:
        runner = await start_http(build_app(ApiContext(engine, registry, settings)), settings)
        try:
            await wait_for_stop(preload(registry, settings), signals.stop)
        finally:
            await drain(runner, registry, settings.server.drain_timeout_s, signals.force)
    finally:
        engine.shutdown()
        log.info("stopped")


def run(settings: Settings) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(settings))
    except OSError as e:  # the port is taken, typically
        log.error("cannot serve on %s: %s", settings.server.host, e.strerror or e)
        return 1
    except (ModelLoadError, RegistryFull) as e:  # a preload failed
        log.error("%s", e)
        return 1
    return 0
