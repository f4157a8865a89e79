"""sd_notify(3) for the daemon: readiness, reload, stop, status, start-timeout extensions,
and a watchdog that pings only while the engine is alive.

Messages go through systemd-python (libsystemd's sd_notify) when it is installed, else
through a sender of our own: one AF_UNIX datagram to $NOTIFY_SOCKET (a leading "@" names
the abstract namespace). Without NOTIFY_SOCKET (not started by systemd as Type=notify)
every call returns False and does nothing, so the daemon calls them unconditionally. A
failed send is logged and returns False: losing a status line must not stop serving.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Callable

try:
    from systemd import daemon as sd_daemon
except ImportError:
    sd_daemon = None

log = logging.getLogger(__name__)


def notify(state: str) -> bool:
    """Send `state` ("KEY=VALUE" lines joined by newlines); True when it was sent."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    try:
        if sd_daemon is not None:
            return bool(sd_daemon.notify(state))
        return _send_datagram(address, state)
    except OSError as exc:
        log.warning("sd_notify %r to %s failed: %s", state.split("\n", 1)[0], address, exc)
        return False


def _send_datagram(address: str, state: str) -> bool:
    if address.startswith("@"):
        address = "\0" + address[1:]
    elif not address.startswith("/"):
        # systemd >= 253 may hand a VM a vsock: address; only libsystemd speaks that.
        log.warning("NOTIFY_SOCKET=%s is not a unix socket; install systemd-python", address)
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.sendto(state.encode(), address)
    return True


def _one_line(text: str) -> str:
    # A newline would start a new assignment: a model name must not be able to say READY=1.
    return " ".join(text.splitlines())


def ready(status: str | None = None) -> bool:
    """Startup (or a reload) finished: systemd marks the unit active."""
    return notify("READY=1" if status is None else f"READY=1\nSTATUS={_one_line(status)}")


def reloading() -> bool:
    """A reload began; send ready() when it is done. MONOTONIC_USEC lets systemd tell this
    reload from an earlier one (required by Type=notify-reload, harmless for Type=notify)."""
    monotonic_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    return notify(f"RELOADING=1\nMONOTONIC_USEC={monotonic_usec}")


def stopping() -> bool:
    """Shutdown began (draining): systemd shows the unit as deactivating."""
    return notify("STOPPING=1")


def status(text: str) -> bool:
    """Free-form one-line status shown by `systemctl status`."""
    return notify(f"STATUS={_one_line(text)}")


def extend_timeout(usec: int) -> bool:
    """Ask for `usec` more microseconds, from now, for the current start/stop/reload phase.
    Send it before the phase's timeout (TimeoutStartSec= while starting) runs out."""
    return notify(f"EXTEND_TIMEOUT_USEC={int(usec)}")


def watchdog_interval_s() -> float | None:
    """WatchdogSec= of this service in seconds, or None when systemd expects no pings from
    this process (no WATCHDOG_USEC, or WATCHDOG_PID names another process)."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if pid and pid != str(os.getpid()):
        return None
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 1e6 if value > 0 else None


class Watchdog:
    """Thread that sends WATCHDOG=1 every interval/2 while `is_alive()` returns True.

    `is_alive` is the daemon's liveness check (the engine loop ticked recently). While it is
    False, or raises, no ping goes out, so a stalled engine makes systemd kill and restart
    the service after WatchdogSec=; pings resume if it recovers before that.
    """

    def __init__(self, is_alive: Callable[[], bool], interval_s: float | None = None):
        self.is_alive = is_alive
        self.interval_s = watchdog_interval_s() if interval_s is None else interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> bool:
        """Start pinging; False (and no thread) when systemd asked for no watchdog."""
        if self.interval_s is None or self._thread is not None:
            return False
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="sd-watchdog", daemon=True)
        self._thread.start()
        return True

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _alive(self) -> bool:
        try:
            return bool(self.is_alive())
        except Exception:
            log.exception("watchdog liveness check failed")
            return False

    def _run(self) -> None:
        period_s = self.interval_s / 2
        stalled = False
        while True:
            if self._alive():
                if stalled:
                    log.warning("engine alive again: watchdog pings resumed")
                    stalled = False
                notify("WATCHDOG=1")
            elif not stalled:
                log.error("engine loop stalled: withholding watchdog pings, systemd restarts "
                          "the service after %.0fs without one", self.interval_s)
                stalled = True
            if self._stop.wait(period_s):
                return
