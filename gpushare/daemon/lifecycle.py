"""What the running daemon does besides serving: signals, systemd status lines, config reloads,
and the test-only engine stall.

- SIGINT/SIGTERM: the first starts the drain, a second cuts it short (`Signals`).
- SIGHUP: `Reloader` reads the config file again and applies what can change live: tenants
  (keys, limits, shares), server limits and keep_alive, the model list. Requests in flight
  keep running. A file that does not parse or validate is rejected whole: the old settings
  stay, the error goes to the log and into systemd's STATUS line until a reload succeeds.
  Settings read only at start (server.host, engine, node, prefix_cache) keep their old
  values, with a warning that they need a restart. systemd hears RELOADING=1 (with
  MONOTONIC_USEC) before and READY=1 after every reload, failed or not.
- `status_line`: the one-line summary `systemctl status` shows, sent every few seconds
  when it changed.
- GPUSHARE_TEST_STALL_FILE (tests only): see engine/test_hooks.py.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Callable

from gpushare.api.context import ApiContext
from gpushare.api.health import engine_alive
from gpushare.api.tenants import apply_tenant_settings
from gpushare.settings.settings import ConfigError, Settings, reload_settings
from gpushare.service import notify

log = logging.getLogger("gpushare.daemon")

STATUS_INTERVAL_S = 2.0
DEFAULT_ENGINE_STALL_S = 30.0  # without a systemd watchdog: when /health calls the engine stalled
MIN_ENGINE_STALL_S = 2.0  # a busy step (a long prefill on CPU) must not count as a stall


def engine_stall_limit_s(watchdog_interval_s: float | None) -> float:
    """How long the engine loop may stay silent before /health and the watchdog call it stalled:
    WatchdogSec= itself (pings stop at once, systemd acts one interval later), at least 2 s."""
    if watchdog_interval_s is None:
        return DEFAULT_ENGINE_STALL_S
    return max(MIN_ENGINE_STALL_S, watchdog_interval_s)


class Signals:
    """SIGINT/SIGTERM: the first sets `stop` (drain), the second `force` (cut the drain short).
    SIGHUP calls `on_reload`."""

    def __init__(self, on_reload: Callable[[], None]) -> None:
        self.stop = asyncio.Event()
        self.force = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self._on_stop, signum)
        loop.add_signal_handler(signal.SIGHUP, on_reload)

    def _on_stop(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.stop.is_set():
            log.warning("%s again: cancelling the requests still running", name)
            self.force.set()
        else:
            log.info("%s: draining requests and stopping (send it again to skip the drain)", name)
            self.stop.set()


def status_line(ctx: ApiContext, reload_error: str | None) -> str:
    stats = ctx.node.stats().models
    loaded = [e.name for e in ctx.registry.loaded()]
    running = sum(m.running for m in stats.values())
    queued = sum(m.waiting for m in stats.values())
    text = (f"{ctx.phase}: {len(loaded)} model{'' if len(loaded) == 1 else 's'} loaded "
            f"({', '.join(loaded) or 'none'}); {running} running, {queued} queued, "
            f"{ctx.in_flight} requests in flight")
    if ctx.node.failure:
        text += f"; ENGINE FAILED: {ctx.node.failure}"
    elif not engine_alive(ctx.node, ctx.engine_stall_s):
        stalled = ctx.node.stalled(ctx.engine_stall_s)
        text += f"; ENGINE LOOP STALLED on {', '.join(stalled)}"
    down = [name for name, status in ctx.supervisor.status.items() if not status.healthy] if ctx.supervisor else []
    if down:
        text += f"; DEVICE UNHEALTHY: {', '.join(down)}"
    if reload_error:
        text += f"; config reload FAILED, still serving the previous config: {reload_error}"
    return text


async def report_status(ctx: ApiContext, reloader: Reloader, stop: asyncio.Event) -> None:
    """Send the status line every STATUS_INTERVAL_S while it changes, until `stop` is set."""
    last = None
    while not stop.is_set():
        if ctx.phase == "serving" and not reloader.busy:
            line = status_line(ctx, reloader.error)
            if line != last:
                notify.status(line)
                last = line
        try:
            await asyncio.wait_for(stop.wait(), STATUS_INTERVAL_S)
        except asyncio.TimeoutError:
            pass


def keep_start_only_settings(old: Settings, new: Settings) -> list[str]:
    """Put back into `new` what only a restart can change; the names of those that differed."""
    changed = []
    if new.server.host != old.server.host:
        changed.append("server.host")
        new.server.host = old.server.host
    for name in ("kv_budget", "device_margin"):  # the KV pool is sized at start, the default budget too
        if getattr(new.memory, f"{name}_bytes") != getattr(old.memory, f"{name}_bytes"):
            changed.append(f"memory.{name}")
            setattr(new.memory, f"{name}_bytes", getattr(old.memory, f"{name}_bytes"))
    for name in ("engine", "node", "prefix_cache_scope"):
        if getattr(new, name) != getattr(old, name):
            changed.append(name)
            setattr(new, name, getattr(old, name))
    return changed + _keep_tensor_parallel(old, new)


def _keep_tensor_parallel(old: Settings, new: Settings) -> list[str]:
    """Tensor-parallel groups are planned and started with the daemon (daemon/groups.py): a model
    keeps the split it started with, and a model that asks for one waits for the restart."""
    keys = ("tensor_parallel", "tensor_parallel_devices", "tensor_parallel_cross_numa")
    before = {m.name: m for m in old.models}
    changed, kept = [], []
    for model in new.models:
        was = before.get(model.name)
        if was is None and (model.tensor_parallel != 1 or model.tensor_parallel_devices):
            changed.append(f"models: {model.name} (a new tensor-parallel model)")
            continue
        if was is not None and any(getattr(model, k) != getattr(was, k) for k in keys):
            changed.append(f"models: {model.name}'s tensor_parallel")
            for k in keys:
                setattr(model, k, getattr(was, k))
        kept.append(model)
    new.models = kept
    return changed


def apply_settings(ctx: ApiContext, new: Settings) -> None:
    """Make `new` the live settings of the tenants, the registry and the handlers."""
    apply_tenant_settings(ctx, new)
    ctx.registry.apply_settings(new)  # loads new preload models in the background
    ctx.settings = new


class Reloader:
    """Runs SIGHUP reloads one at a time; `error` says why the last one failed (None: it did not)."""

    def __init__(self, ctx: ApiContext):
        self.ctx = ctx
        self.error: str | None = None
        self._task: asyncio.Task | None = None
        self._again = False  # another SIGHUP came during a reload: run once more after it
        self._pending = False  # a SIGHUP came while starting

    @property
    def busy(self) -> bool:
        return self._task is not None and not self._task.done()

    def request(self) -> None:
        """The SIGHUP handler."""
        if self.ctx.phase == "draining":
            log.info("SIGHUP while stopping: no reload")
        elif self.ctx.phase == "starting":
            log.info("SIGHUP while starting: the config is read again once the preloads are done")
            self._pending = True
        elif self.busy:
            self._again = True
        else:
            self._task = asyncio.create_task(self._run())

    def started(self) -> None:
        """Serving began: run a reload asked for while starting."""
        if self._pending:
            self._pending = False
            self.request()

    async def finish(self) -> None:
        """Let a reload in progress end (the drain waits for it)."""
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            self._again = False
            await self.reload()
            if not self._again:
                return

    async def reload(self) -> None:
        notify.reloading()
        old = self.ctx.settings
        where = old.config_path or "defaults and environment"
        log.info("SIGHUP: reading the config again (%s)", where)
        try:
            new = await asyncio.to_thread(reload_settings, old)
        except ConfigError as e:
            self.error = str(e)
            log.error("config reload rejected, still serving the previous config: %s", e)
        else:
            for name in keep_start_only_settings(old, new):
                log.warning("config reload: %s changed; it takes effect at the next restart", name)
            try:
                apply_settings(self.ctx, new)
            except Exception as e:  # a bug, or a change the registry refused: keep serving
                self.error = f"applying the new config failed: {e}"
                log.exception("config reload: applying the new config failed")
            else:
                self.error = None
                log.info("config reloaded: %d models configured, %d tenants",
                         len(new.models), len(new.tenants))
        notify.ready(status_line(self.ctx, self.error))
