"""The supervisor's handle on one engine worker process (engine/worker.py): a Device.

It starts the process with its device's environment and CPUs, sends typed messages, and a reader
thread takes everything coming back: outputs go to the callback of their request, snapshots
replace ``snapshot`` whole (all the event loop reads of the engine), replies and load progress go
to the caller waiting on them. It is a Device (protocol/device.py), as the in-process one is, so
the registry and the API do not care where the engine runs.

When the process dies (killed, OOM, a CUDA error, an engine failure) every request in flight
ends with an "abort" output naming the death (the API answers 503 with Retry-After, or ends the
stream with an error object), every waiting call raises WorkerDied, and ``on_exit`` tells the
supervisor, which restarts the worker (residency/device_supervisor.py).
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Callable

from gpushare.protocol import messages as m
from gpushare.protocol.device import Device
from gpushare.protocol.engine_stats import EngineSnapshot, EngineStats, has_work
from gpushare.protocol.outputs import RequestOutput
from gpushare.protocol.tenant_policy import TenantPolicy
from gpushare.catalog.model_head import LoadedModel, load_model_head

log = logging.getLogger("gpushare.workers")

START_TIMEOUT_S = 120.0  # importing torch and starting the engine; minutes only on a cold, slow disk
STOP_TIMEOUT_S = 10.0
# An attach: the worker's read of the adapter's files (its own timeout, models/lora.READ_TIMEOUT_S), then
# its turn after the loads queued before it; a worker that has not answered by then is stuck.
ATTACH_TIMEOUT_S = 600.0


class WorkerDied(RuntimeError):
    """The worker process ended while a call waited on it."""


WORKER_GOMP_SPINCOUNT = "1000"


def openmp_defaults(environ) -> dict[str, str]:
    """How long a worker's idle OpenMP threads spin before they sleep, unless the environment says.

    libgomp spins 300,000 rounds by default. A node's cores also run the daemon, its clients and
    other workers, and those spinning threads starve them; a thread that then loses its core holds
    up every parallel region. Measured on 2 cores (docs/benchmarks.md): under a tenant's 429 storm
    the victim's TTFT p99 went from 1.4x alone (1,000 rounds) to 27-36x (the default) and the
    flooding tenant's throughput from 165 to 40-58 tok/s; unloaded, 1,000 rounds cost 9% of one
    stream's tok/s and nothing at 16 and 64 streams (100 rounds cost 31%)."""
    if "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ:
        return {}
    return {"GOMP_SPINCOUNT": WORKER_GOMP_SPINCOUNT}


class WorkerClient(Device):
    world_size = 1  # engine workers behind this device (a tensor-parallel group has more: group_client.py)

    def __init__(self, spec: m.WorkerSpec, env: dict[str, str], kv_pool_bytes: int,
                 on_exit: Callable[["WorkerClient", str], None] | None = None):
        self.name = spec.name
        self.spec = spec
        self.env = env  # the device's variables (CUDA_VISIBLE_DEVICES, MPS), over the daemon's own
        self.kv_pool_bytes = kv_pool_bytes
        self.on_exit = on_exit  # (client, why) from the reader thread, once the process is gone
        self.pid: int | None = None
        self.tenant_policies: dict[str, TenantPolicy] = {}
        self.snapshot = self._blank_snapshot()
        self.exit_reason: str | None = None
        self._process: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._send_lock = threading.Lock()
        self._sinks: dict[str, list] = {}  # request id -> [on_output, answers still running]
        self._calls: dict[int, tuple[Future, Callable | None]] = {}  # call id -> (future, on progress)
        self._call_ids = itertools.count(1)
        self._lock = threading.Lock()  # guards _sinks and _calls against the reader thread
        self._ready = threading.Event()
        self._reader: threading.Thread | None = None
        self._exit_told = False  # on_exit already called for this process (its engine failed)

    def _blank_snapshot(self) -> EngineSnapshot:
        """What a worker that is not running (yet) shows: no models, nothing queued."""
        return EngineSnapshot(EngineStats(0, kv_pool_bytes=self.kv_pool_bytes, max_num_seqs=self.spec.config.max_num_seqs),
                              {}, time.monotonic(), None)

    # ---- life -----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the process and wait until its engine runs (blocking: call it off the event loop)."""
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join()  # the last process's end is fully handled before this one starts
        ours, theirs = socket.socketpair()
        env = {**os.environ, **openmp_defaults(os.environ), **self.env}
        self._process = subprocess.Popen([sys.executable, "-m", "gpushare.engine.worker", str(theirs.fileno())],
                                         env=env, pass_fds=(theirs.fileno(),))
        theirs.close()
        self._conn = Connection(ours.detach())
        self.exit_reason = None
        self._exit_told = False
        self.snapshot = self._blank_snapshot()
        self._ready.clear()
        self._send(self.spec)
        self._reader = threading.Thread(target=self._read_loop, name=f"gpushare-worker-{self.name}", daemon=True)
        self._reader.start()
        if not self._ready.wait(START_TIMEOUT_S) or self.exit_reason is not None:
            self.kill()
            raise WorkerDied(f"the engine worker for {self.name} did not start: {self.exit_reason or 'timed out'}")
        log.info("engine worker for %s started: pid %d, CPUs %s", self.name, self.pid, self.spec.config.cpus)

    def shutdown(self) -> None:
        """Ask the worker to stop, then make sure it has (blocking)."""
        if self._process is None:
            return
        self.on_exit = None  # an asked-for exit needs no restart
        try:
            self._send(m.Stop())
        except WorkerDied:
            pass
        try:
            self._process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    @property
    def config(self):
        """The worker engine's EngineConfig (its device, cpus, limits)."""
        return self.spec.config

    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None and self.exit_reason is None

    @property
    def failure(self) -> str | None:
        """Never failed for good: a worker whose engine fails exits, and the supervisor restarts it."""
        return None

    @property
    def last_tick_s(self) -> float:
        return self.snapshot.last_tick_s

    # ---- the engine's surface -------------------------------------------------------------
    def submit(self, request, on_output: Callable[[RequestOutput], None]) -> str:
        if self.snapshot.failure is not None:  # it is exiting; the supervisor restarts it
            raise KeyError(f"the engine worker for {self.name} failed: {self.snapshot.failure}")
        with self._lock:
            self._sinks[request.request_id] = [on_output, request.params.n]
        try:
            self._send(m.Submit(request))
        except WorkerDied as e:
            self._sinks.pop(request.request_id, None)
            raise KeyError(str(e)) from None
        return request.request_id

    def cancel(self, request_id: str) -> None:
        try:
            self._send(m.Cancel(request_id))
        except WorkerDied:
            pass  # its death ended the request already

    def embed(self, request) -> Future:
        """Cancelling the future (its client left) drops the request's inputs not yet run in the worker."""
        future = self._call(lambda call_id: m.Embed(call_id, request))
        future.add_done_callback(lambda f: self.cancel(request.request_id) if f.cancelled() else None)
        return future

    def stats(self) -> EngineStats:
        return self.snapshot.stats

    def tenant_stats(self) -> dict:
        return self.snapshot.tenants

    def has_work(self, model_name: str | None = None) -> bool:
        return has_work(self.snapshot.stats, model_name)

    def set_tenants(self, policies: list[TenantPolicy]) -> None:
        self.tenant_policies = {p.name: p for p in policies}
        self._send_quietly(m.SetTenants(policies))

    def set_share_weight(self, name: str, share_weight: float) -> None:
        self._send_quietly(m.SetShareWeight(name, share_weight))

    # ---- models ---------------------------------------------------------------------------
    def load(self, name: str, path: str, dtype: str, weights: str, share_weight: float, progress, warm,
             warm_key: tuple) -> tuple[LoadedModel, int, bool]:
        """Build the model in the worker (from its warm tier when ``warm`` says it is there); returns
        the model's text side for this process, its weight bytes and whether it came warm. Blocking."""
        head = warm or load_model_head(path, weights, dtype, self.spec.config.device)
        loaded = self.build(name, path, dtype, weights, share_weight, progress, warm_key if warm else None)
        head.weights, head.kernel = loaded.weights, loaded.kernel
        head.metadata["weights"], head.metadata["kernel"] = loaded.weights, loaded.kernel
        return head, loaded.weight_bytes, loaded.warm

    def build(self, name: str, path: str, dtype: str, weights: str, share_weight: float, progress,
              warm_key: tuple | None) -> m.Loaded:
        """Build the model in the worker, from its warm tier under ``warm_key`` when given. Blocking."""
        return self._call(lambda call_id: m.LoadModel(call_id, name, path, dtype, weights, share_weight, warm_key),
                          progress).result()

    def unload(self, name: str, model: LoadedModel, warm_key: tuple | None) -> LoadedModel | None:
        """Remove the model from the worker's engine, keeping it warm there under ``warm_key``; returns
        what the supervisor's warm tier holds for it (the text side). Blocking."""
        self._call(lambda call_id: m.UnloadModel(call_id, name, warm_key)).result()
        return model if warm_key is not None else None

    def drop_warm(self, warm_key: tuple) -> None:
        self._send_quietly(m.DropWarm(warm_key))

    def attach_adapter(self, name: str, base: str, path: str) -> int:
        """Serve the LoRA adapter at `path` as `name` on loaded model `base`; its weight bytes. Blocking;
        ValueError (as the worker raised it) when it does not fit the base or its file is refused, and
        RuntimeError when the worker has not answered in ATTACH_TIMEOUT_S (an adapter it attaches after
        that is detached again: nobody serves it)."""
        future = self._call(lambda call_id: m.AttachAdapter(call_id, name, base, path))
        try:
            return future.result(timeout=ATTACH_TIMEOUT_S)
        except TimeoutError:
            if future.done():  # the worker answered as the wait ended: its answer (its own read timeout, say)
                return future.result()
        future.add_done_callback(lambda f: f.exception() is None and self._send_quietly(
            m.DetachAdapter(next(self._call_ids), name)))
        raise RuntimeError(f"the engine worker for {self.name} did not attach adapter {name!r} within "
                           f"{ATTACH_TIMEOUT_S:g}s")

    def detach_adapter(self, name: str) -> None:
        """Blocking; its requests end with an error."""
        self._call(lambda call_id: m.DetachAdapter(call_id, name)).result()

    # ---- plumbing -------------------------------------------------------------------------
    def _send(self, message) -> None:
        with self._send_lock:
            if self._conn is None or self.exit_reason is not None:
                raise WorkerDied(f"the engine worker for {self.name} is not running ({self.exit_reason or 'stopped'})")
            try:
                self._conn.send(message)
            except (OSError, EOFError) as e:
                raise WorkerDied(f"the engine worker for {self.name} is gone ({e})") from None

    def _send_quietly(self, message) -> None:
        """For settings: a dead worker gets them again when it restarts."""
        try:
            self._send(message)
        except WorkerDied:
            pass

    def _call(self, make_message, on_progress=None) -> Future:
        future: Future = Future()
        call_id = next(self._call_ids)
        with self._lock:
            self._calls[call_id] = (future, on_progress)
        try:
            self._send(make_message(call_id))
        except WorkerDied as e:
            with self._lock:
                self._calls.pop(call_id, None)
            future.set_exception(e)
        return future

    def _read_loop(self) -> None:
        conn = self._conn
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            self._dispatch(message)
        self._died()

    def _dispatch(self, message) -> None:
        if isinstance(message, m.Outputs):
            for request_id, out in message.items:
                with self._lock:
                    sink = self._sinks.get(request_id)
                    if sink is not None and out.finished:
                        sink[1] -= 1
                        if sink[1] == 0 or out.finish_reason in ("error", "abort", "rejected"):
                            del self._sinks[request_id]
                if sink is not None:
                    sink[0](out)
        elif isinstance(message, m.Snapshot):
            self.snapshot = message.snapshot
            if message.snapshot.failure is not None and not self._exit_told and self.on_exit is not None:
                # Its engine failed and the process is ending: the supervisor need not wait for the exit.
                self._exit_told = True
                self.on_exit(self, f"the engine of device {self.name} failed: {message.snapshot.failure}")
        elif isinstance(message, m.Reply):
            with self._lock:
                future, _ = self._calls.pop(message.call_id, (None, None))
            if future is not None and not future.done():  # an embed's caller may have cancelled it
                if message.error is not None:
                    future.set_exception(message.error)
                else:
                    future.set_result(message.value)
        elif isinstance(message, m.Progress):
            _, on_progress = self._calls.get(message.call_id, (None, None))
            if on_progress is not None:
                on_progress(message.done_bytes, message.total_bytes)
        elif isinstance(message, m.Ready):
            self.pid = message.pid
            self._ready.set()

    def _died(self) -> None:
        """The connection closed: the process is gone or going. End everything that waited on it."""
        code = self._process.wait() if self._process is not None else None
        why = (f"killed by signal {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exited with code {code}")
        reason = f"the engine worker for device {self.name} (pid {self.pid}) {why}"
        with self._send_lock:
            self.exit_reason = reason
            if self._conn is not None:
                self._conn.close()
        self.snapshot = self._blank_snapshot()
        with self._lock:
            sinks, self._sinks = self._sinks, {}
            calls, self._calls = self._calls, {}
        for request_id, (on_output, _) in sinks.items():
            on_output(RequestOutput(request_id, "", [], True, "abort", f"{reason}; retry"))
        for future, _ in calls.values():
            if not future.done():
                future.set_exception(WorkerDied(reason))
        self._ready.set()
        if self.on_exit is None:  # asked to stop
            log.info("%s", reason)
            return
        log.error("%s", reason)
        if not self._exit_told:
            self.on_exit(self, reason)
