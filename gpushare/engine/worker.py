"""An engine worker process: one Engine on one device, behind typed messages (protocol/messages.py).

Started by the supervisor (residency/worker_client.py) as ``python -m gpushare.engine.worker FD``
with its device's environment (CUDA_VISIBLE_DEVICES, MPS) already set, so CUDA sees one GPU or
MIG instance. FD is its end of a socket pair; the first message is the WorkerSpec.

Threads: the main thread reads messages and hands them to the engine (submits and cancels go
straight to its inbox); loads and unloads run in order, each in a thread that ends with it
(passing_threads.py), so a long load never holds up requests; one sender thread writes everything
going back, coalescing what piled up (outputs of several turns into one message, only the newest
snapshot). The engine thread calls ``on_output``/``on_snapshot``, which only queue. The process
ends when the supervisor says Stop or its socket closes (the supervisor is gone): a worker never
outlives its daemon.

A rank of a tensor-parallel group (WorkerSpec.group) first joins its group. The first rank then
runs as above, its models split and broadcasting each forward pass; the other ranks run
FollowerHost: the supervisor's loads and unloads, and the group's ops on a thread of their own.
A follower ends when its group breaks up, so a rank that dies takes its group down.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
from concurrent.futures import Future
from functools import partial
from multiprocessing.connection import Connection

import torch

from gpushare.protocol import messages as m
from gpushare.engine.engine import Engine
from gpushare.engine.kv_pool import DeviceKVPool, kv_bytes_per_block, resolve_kv_dtype
from gpushare.engine.passing_threads import PassingThreads, timed_read
from gpushare.engine.tp_runtime import (Follower, FollowerModel, LeaderModel, broadcast_decommit, join_group,
                                             use_all_reduce)
from gpushare.engine.test_hooks import install_test_stall
from gpushare.protocol.outputs import RequestOutput
from gpushare.models.host_copy import to_device, to_host
from gpushare.models.loader import load_model, return_freed_memory
from gpushare.models.lora import READ_TIMEOUT_S as ADAPTER_READ_TIMEOUT_S, read_adapter
from gpushare.catalog.tensor_split import rank_config, split_model, vocab_widths

log = logging.getLogger("gpushare.worker")

FAILED_EXIT_CODE = 3  # the engine loop failed for good (engine.py)
EXIT_FAILED = object()  # queued after the failed engine's last snapshot: the sender ends the process


class Outbox:
    """Everything going back to the supervisor, sent by one thread in arrival order."""

    def __init__(self, conn: Connection):
        self._conn = conn
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._send_loop, name="gpushare-worker-send", daemon=True)
        self._thread.start()

    def put(self, message) -> None:
        self._queue.put(message)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _send_loop(self) -> None:
        while True:
            batch = [self._queue.get()]
            while True:  # take what piled up while the last send ran
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            for message in coalesce(batch):
                if message is None:
                    return
                if message is EXIT_FAILED:
                    # The engine failed for good and everything it said is sent: end the process now, so
                    # the supervisor sees it gone before anyone sends more work here.
                    os._exit(FAILED_EXIT_CODE)
                try:
                    self._conn.send(message)
                except (OSError, EOFError):  # the supervisor is gone; the main thread ends the process
                    return


def coalesce(batch: list) -> list:
    """One Outputs message for consecutive outputs, and only the newest of consecutive snapshots;
    the order of everything else (replies, progress) is kept."""
    out: list = []
    for message in batch:
        if isinstance(message, m.Outputs) and out and isinstance(out[-1], m.Outputs):
            out[-1] = m.Outputs(out[-1].items + message.items)
        elif isinstance(message, m.Snapshot) and out and isinstance(out[-1], m.Snapshot):
            out[-1] = message
        else:
            out.append(message)
    return out


class WorkerHost:
    """Handles the supervisor's messages with one Engine and the worker's warm tier (models kept
    built in host memory; the supervisor's WarmCache decides what stays, and says DropWarm)."""

    def __init__(self, engine: Engine, outbox: Outbox, spec: m.WorkerSpec):
        self.engine = engine
        self.outbox = outbox
        self.spec = spec
        self.warm: dict[tuple, object] = {}  # warm key -> LoadedModel, weights in host memory
        self.loaded: dict = {}  # name -> LoadedModel
        self._loader = PassingThreads("gpushare-worker-load")  # their OpenMP teams end with them
        engine.on_snapshot = lambda snapshot: outbox.put(m.Snapshot(snapshot))

    def exit_when_failed(self) -> None:
        """Once the engine loop has ended (thread "gpushare-worker-watch"): if it failed, it has ended
        every request (engine.py) and all of that is queued; the process then ends after sending it."""
        thread = self.engine.loop_thread
        if thread is not None:
            thread.join()
        if self.engine.failure is not None:
            log.error("the engine failed; the worker exits: %s", self.engine.failure)
            self.outbox.put(EXIT_FAILED)

    def handle(self, message) -> bool:
        """False once the worker should stop."""
        if isinstance(message, m.Submit):
            self._submit(message.request)
        elif isinstance(message, m.Cancel):
            self.engine.cancel(message.request_id)
        elif isinstance(message, m.Embed):
            self._embed(message)
        elif isinstance(message, (m.LoadModel, m.UnloadModel)):
            self._loader.submit(_reply, self.outbox, message.call_id,
                                self._load if isinstance(message, m.LoadModel) else self._unload, message)
        elif isinstance(message, m.AttachAdapter):
            self._attach(message)
        elif isinstance(message, m.DetachAdapter):  # in order with the loads of their bases
            self._loader.submit(_reply, self.outbox, message.call_id, self._detach, message)
        elif isinstance(message, m.DropWarm):
            self._loader.submit(self.warm.pop, message.warm_key, None)
        elif isinstance(message, m.SetTenants):
            self.engine.set_tenants(message.policies)
        elif isinstance(message, m.SetShareWeight):
            self.engine.set_share_weight(message.name, message.share_weight)
        elif isinstance(message, m.Stop):
            return False
        return True

    def _submit(self, request) -> None:
        request_id = request.request_id

        def on_output(out) -> None:  # engine thread
            self.outbox.put(m.Outputs([(request_id, out)]))

        try:
            self.engine.submit(request, on_output)
        except Exception as e:  # its grammar does not compile (400), its model just left, the engine failed
            reason = "rejected" if isinstance(e, ValueError) else "abort" if isinstance(e, KeyError) else "error"
            message = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
            self.outbox.put(m.Outputs([(request_id, RequestOutput(request_id, "", [], True, reason, message))]))

    def _embed(self, message: m.Embed) -> None:
        try:
            future = self.engine.embed(message.request)
        except Exception as e:
            self.outbox.put(m.Reply(message.call_id, error=e))
            return
        def reply(f) -> None:
            if f.cancelled():  # the supervisor's Cancel: its caller left and waits for no reply
                return
            self.outbox.put(m.Reply(message.call_id, error=f.exception()) if f.exception()
                            else m.Reply(message.call_id, f.result()))

        future.add_done_callback(reply)

    def _load(self, message: m.LoadModel) -> m.Loaded:
        def progress(done_bytes: int, total_bytes: int) -> None:
            self.outbox.put(m.Progress(message.call_id, done_bytes, total_bytes))

        self.engine.fit_kv_pool(floor=True)  # on a GPU, room for the weights (engine/kv_sizing.py)
        model, warm = _take_or_load(self.spec, self.warm, message, progress)
        if self.spec.group is not None and not warm:
            model.model = LeaderModel(message.name, model.model,
                                      vocab_widths(model.whole_config, self.spec.group.world_size))
        self.engine.add_model(message.name, model, share_weight=message.share_weight)
        self.loaded[message.name] = model
        return m.Loaded(model.weights, model.weight_bytes, warm, model.kernel)

    def _unload(self, message: m.UnloadModel) -> None:
        self.engine.remove_model(message.name)
        _retire(self.loaded, self.warm, message)

    def _attach(self, message: m.AttachAdapter) -> None:
        """Read the adapter's files in a thread of their own, outside the ordered loads: a read that hangs
        (a stalled mount) holds up no other model's or adapter's load, and is answered with an error after
        ADAPTER_READ_TIMEOUT_S (what it read later is dropped). Once read, the engine takes it in order
        with the loads; the reply is its weight bytes, or a ValueError naming what does not fit."""
        if self.spec.group is not None:
            error = ValueError(f"adapter {message.name!r}: LoRA adapters are not served on tensor-parallel models")
            self.outbox.put(m.Reply(message.call_id, error=error))
            return

        def add(adapter, message: m.AttachAdapter) -> int:
            self.engine.add_adapter(message.name, message.base, adapter)
            return adapter.nbytes

        def read_then(reading: Future) -> None:
            if reading.exception() is not None:
                log.warning("reading adapter %s failed: %s", message.name, reading.exception())
                self.outbox.put(m.Reply(message.call_id, error=reading.exception()))
            else:
                self._loader.submit(_reply, self.outbox, message.call_id, partial(add, reading.result()), message)

        timed_read(read_adapter, (message.path, message.name), ADAPTER_READ_TIMEOUT_S,
                   f"adapter {message.name!r}: its files took over {ADAPTER_READ_TIMEOUT_S:g}s to read", read_then)

    def _detach(self, message: m.DetachAdapter) -> None:
        self.engine.remove_adapter(message.name)


def _take_or_load(spec: m.WorkerSpec, warm: dict, message: m.LoadModel, progress=None) -> tuple:
    """(the model, whether it came from the warm tier); a rank of a group builds its part."""
    kept = warm.pop(message.warm_key, None) if message.warm_key is not None else None
    if kept is not None:
        return to_device(kept, spec.config.device), True
    model = load_model(message.path, dtype=message.dtype, device=spec.config.device, progress=progress,
                       weights=message.weights, tensor_parallel=_rank_of(spec))
    if spec.group is not None:
        use_all_reduce(model.model)
    return model, False


def _retire(loaded: dict, warm: dict, message: m.UnloadModel) -> None:
    """Drop an unloaded model, or keep it warm in host memory when the supervisor says so."""
    model = loaded.pop(message.name)
    if message.warm_key is not None:
        warm[message.warm_key] = to_host(model)
    del model
    return_freed_memory()


def _rank_of(spec: m.WorkerSpec) -> tuple[int, int] | None:
    return None if spec.group is None else (spec.group.rank, spec.group.world_size)


class FollowerHost:
    """A tensor-parallel rank after the first: loads and unloads its part of each model when the
    supervisor says, and runs what the first rank broadcasts (engine/tp_runtime.py)."""

    def __init__(self, spec: m.WorkerSpec, outbox: Outbox):
        self.spec = spec
        self.outbox = outbox
        config = spec.config
        self.kv_dtype = resolve_kv_dtype(config.kv_dtype, config.device, config.weights)
        self.follower = Follower(DeviceKVPool(config.kv_cache_bytes, config.device, config.kv_slab_blocks))
        self.warm: dict[tuple, object] = {}
        self.loaded: dict = {}
        self._loader = PassingThreads("gpushare-worker-load")  # their OpenMP teams end with them

    def run_ops(self) -> None:
        """Thread "gpushare-rank": pinned as an engine thread, it runs the group's ops until the group ends."""
        if self.spec.config.cpus:
            os.sched_setaffinity(0, self.spec.config.cpus)
        if self.spec.config.num_threads:
            torch.set_num_threads(self.spec.config.num_threads)
        if self.spec.config.device.startswith("cuda:"):
            torch.cuda.set_device(self.spec.config.device)
        try:
            self.follower.run()
        except Exception as e:  # the first rank is gone: the group restarts as one
            log.error("the tensor-parallel group broke up: %s", e)
        self.outbox.put(EXIT_FAILED)

    def handle(self, message) -> bool:
        if isinstance(message, (m.LoadModel, m.UnloadModel)):
            self._loader.submit(_reply, self.outbox, message.call_id,
                                self._load if isinstance(message, m.LoadModel) else self._unload, message)
        elif isinstance(message, m.DropWarm):
            self._loader.submit(self.warm.pop, message.warm_key, None)
        elif isinstance(message, m.Stop):
            return False
        return True  # requests and settings go to the first rank only

    def _load(self, message: m.LoadModel) -> m.Loaded:
        config = self.spec.config
        model, warm = _take_or_load(self.spec, self.warm, message)
        whole = model.whole_config
        first = rank_config(whole, split_model(whole, self.spec.group.world_size)[0])
        stride = kv_bytes_per_block(first, config.block_size, self.kv_dtype)
        views = self.follower.kv_pool.layer_views(model.config, config.block_size, self.kv_dtype, stride)
        widths = vocab_widths(whole, self.spec.group.world_size)
        self.follower.add(message.name, FollowerModel(model.model, views, widths))
        self.loaded[message.name] = model
        return m.Loaded(model.weights, model.weight_bytes, warm, model.kernel)

    def _unload(self, message: m.UnloadModel) -> None:
        self.follower.remove(message.name)
        _retire(self.loaded, self.warm, message)


def _reply(outbox: Outbox, call_id: int, fn, message) -> None:
    try:
        outbox.put(m.Reply(call_id, fn(message)))
    except Exception as e:
        log.exception("%s failed", type(message).__name__)
        outbox.put(m.Reply(call_id, error=e))


def serve_follower(spec: m.WorkerSpec, conn: Connection) -> None:
    outbox = Outbox(conn)
    host = FollowerHost(spec, outbox)
    threading.Thread(target=host.run_ops, name="gpushare-rank", daemon=True).start()
    outbox.put(m.Ready(os.getpid()))
    try:
        _receive(conn, host)
    finally:
        outbox.close()


def _receive(conn: Connection, host) -> None:
    """Hand the supervisor's messages to ``host`` until it says Stop or its socket closes."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the supervisor is gone
            return
        if not host.handle(message):
            return


def serve(conn: Connection) -> None:
    spec: m.WorkerSpec = conn.recv()
    logging.basicConfig(level=logging.INFO, format=f"gpushare worker {spec.name}: %(levelname)s %(message)s",
                        stream=sys.stderr)
    if spec.group is not None:
        join_group(spec.group, spec.config.device)
        if spec.group.rank > 0:
            serve_follower(spec, conn)
            return
    engine = Engine(spec.config)
    if spec.group is not None:
        engine.kv_pool.on_decommit = broadcast_decommit
    install_test_stall(engine)
    outbox = Outbox(conn)
    host = WorkerHost(engine, outbox, spec)
    engine.start()
    threading.Thread(target=host.exit_when_failed, name="gpushare-worker-watch", daemon=True).start()
    log.info("engine thread %d pinned to CPUs %s, %d torch threads", engine.thread_native_id,
             ",".join(map(str, spec.config.cpus or [])), spec.config.num_threads or 0)
    outbox.put(m.Ready(os.getpid()))
    try:
        _receive(conn, host)
    finally:
        engine.shutdown()
        outbox.close()


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])))
