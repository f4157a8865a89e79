"""Engine: one thread that owns the device and steps every loaded model's batches.

Other threads talk to it through ``submit``/``cancel``/``embed`` (a thread-safe inbox) and get
tokens back through each request's ``on_output`` callback, called from the engine thread.
Each loop turn runs one step of one model; models with work share steps by weighted fairness.
New prompts of a tenant that the admission order puts ahead of every other running tenant (higher
priority, or not above its fair share) get a step of their own, before the next step or between
two layers of the one in flight, so another tenant's flood does not delay their first token.

Failures stay with the requests they touch: a failed step fails its batch, a failure on one
sequence (its sampling, its text) fails that sequence, a failed inbox item its own request. An
error that escapes all of these leaves the engine's state in doubt: the loop then stops for good,
ends every pending request with an error, and ``submit`` and ``embed`` raise EngineFailed
(``failure`` says why), so /health, /ready and the systemd watchdog report a dead engine.
"""

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import replace
from typing import Callable

import torch

from gpushare.protocol.engine_config import EngineConfig
from gpushare.engine import adapters
from gpushare.engine.inbox import AddSequence, Call, Cancel, EmbedInputs, Inbox, Wake, handle_item, refuse
from gpushare.engine.embed_batch import ResidentEncoder, PendingEmbed
from gpushare.engine.embed_queue import EmbedQueue
from gpushare.engine.engine_snapshot import engine_stats, tenant_stats
from gpushare.protocol.engine_stats import EngineSnapshot, EngineStats, has_work
from gpushare.engine.kv_cache import BlockPool
from gpushare.engine.kv_pool import DeviceKVPool, kv_bytes_per_block, resolve_kv_dtype
from gpushare.engine import kv_sizing
from gpushare.engine.kv_sharing import borrow_victim, shed_idle_models
from gpushare.engine.model_runner import ModelRunner
from gpushare.engine.resident_model import ResidentModel
from gpushare.protocol.request import (EmbedRequest, EngineFailed, GenerationRequest, check_embed,
                                       check_request, model_limits, tenant_limit_bytes)
from gpushare.engine.request_checks import new_sequence
from gpushare.protocol.sampling_params import SamplingParams
from gpushare.engine.scheduler import Scheduler
from gpushare.protocol.outputs import RequestOutput
from gpushare.engine.step_outputs import StepOutputs
from gpushare.engine.steps import run_urgent_prompts, schedule_and_run
from gpushare.engine.tenant_ledger import TenantLedger
from gpushare.protocol.tenant_policy import DEFAULT_TENANT, TenantPolicy, TenantStats
from gpushare.models.loader import return_freed_memory
from gpushare.catalog.model_head import LoadedModel
from gpushare.models.lora import LoraAdapter

log = logging.getLogger(__name__)

SNAPSHOT_INTERVAL_S = 0.05  # the oldest a snapshot gets while steps run and no request ends


class Engine:
    def __init__(self, config: EngineConfig | None = None):
        self.config = config or EngineConfig()
        self.models: dict[str, ResidentModel] = {}  # mutated only on the engine thread
        self.encoders: dict[str, ResidentEncoder] = {}  # encoder models (no KV cache, no scheduler)
        self.adapter_bases: dict[str, str] = {}  # LoRA adapter model -> the loaded model it runs on
        self.embeds = EmbedQueue()  # embed requests taken in, first come first served
        self.ledger = TenantLedger()
        self.step_outputs = StepOutputs(self.ledger)  # requests taken in, and their outputs until the next flush
        self.requests = self.step_outputs.requests
        self.tenant_policies: dict[str, TenantPolicy] = {}
        self.kv_pool = DeviceKVPool(self.config.kv_cache_bytes, self.config.device, self.config.kv_slab_blocks)
        self.kv_dtype = resolve_kv_dtype(self.config.kv_dtype, self.config.device, self.config.weights)
        self._idle_since_s: dict[int, float] = {}  # kv_sharing.shed_idle_models' memory
        self._next_shed_check_s = 0.0  # idle models are looked at once per idle_tick_s, not every step
        self._kv_fit_pending = False  # a model went: the GPU pool grows at the next idle check (kv_sizing)
        self.thread_native_id: int | None = None
        self.steps = 0
        self.last_tick_s = time.monotonic()
        self.on_step: Callable[["Engine"], None] | None = None  # test hook: runs after every step
        # Called on the engine thread with each new snapshot (a worker process forwards them).
        self.on_snapshot: Callable[[EngineSnapshot], None] | None = None
        self.snapshot = EngineSnapshot(engine_stats(self), {}, self.last_tick_s, None)
        self._snapshot_s = 0.0  # when the latest snapshot was made (time.monotonic)
        self._inbox = Inbox()
        self.new_work = self._inbox.new_work  # a step's should_pause (models/pause_signal.py)
        self._deferred: list = []  # inbox items taken during a paused step, handled after it
        self._thread: threading.Thread | None = None
        self._pinned = threading.Event()
        self._stopping = False
        self.failure: str | None = None  # why the loop stopped for good; set once, on the engine thread
        self._inbox_lock = threading.Lock()  # orders submits against the final drain of a failed loop

    # ---- public, thread-safe -------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="gpushare-engine", daemon=True)
            self._thread.start()
            self._pinned.wait()

    def shutdown(self) -> None:
        if self._thread is not None:
            self._stopping = True
            self._inbox.put(Wake())
            self._thread.join()
            self._thread = None

    @property
    def loop_thread(self) -> threading.Thread | None:
        """The engine thread, while started (join it to wait for the loop's end)."""
        return self._thread

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def add_model(self, name: str, loaded: LoadedModel, share_weight: float = 1.0) -> None:
        """Serve ``loaded`` as ``name``; its KV cache grows and shrinks in the engine's device pool."""
        if loaded.device.startswith("cuda") and not getattr(loaded.config, "is_encoder", False):
            # every Triton kernel variant compiles here, off the engine thread, not in a request's step
            from gpushare.models.triton_warmup import warm_up  # Triton is imported for GPUs only

            warm_up(loaded.model, self.kv_pool.layer_views(loaded.config, self.config.block_size, self.kv_dtype),
                    loaded.dtype)

        def add():
            if name in self.models or name in self.encoders:
                raise ValueError(f"model {name!r} is already loaded")
            if getattr(loaded.config, "is_encoder", False):
                self.encoders[name] = ResidentEncoder(name, loaded)
                self.flush()
                return
            per_block = kv_bytes_per_block(loaded.config, self.config.block_size, self.kv_dtype)
            pool = BlockPool(self.kv_pool, self.config.block_size, per_block, self.ledger, self.config.prefix_cache)
            scheduler = Scheduler(pool, self.config.max_num_seqs, self.config.max_num_batched_tokens,
                                  loaded.config.kv_window)
            scheduler.borrow = self._borrow
            runner = ModelRunner(loaded, pool, self.kv_pool.layer_views(loaded.config, self.config.block_size,
                                                                         self.kv_dtype))
            self.models[name] = ResidentModel(name, loaded, scheduler, runner, share_weight)
            kv_sizing.fit(self)  # a GPU pool grows into what the weights left
            self.flush()  # whoever waits on add_model sees the model in the snapshot

        self._run_on_engine(add)

    def remove_model(self, name: str) -> None:
        def remove():
            self.embeds.fail(KeyError(f"model {name!r} was unloaded"), name)
            if self.encoders.pop(name, None) is not None:
                self.flush()
                return
            resident = self.models.pop(name)
            adapters.forget_base(self, name)
            for seq in list(resident.scheduler.running) + list(resident.scheduler.waiting):
                self.step_outputs.finish(resident, seq, "abort",
                                         error=f"the request was cancelled: model {name!r} was unloaded")
            resident.scheduler.pool.close()
            self._kv_fit_pending = True
            self.flush()

        self._run_on_engine(remove)

    def fit_kv_pool(self, floor: bool = False) -> None:
        """On a GPU: size the KV pool to what the device leaves now, or (``floor``, before a load) to
        memory.kv_budget; running sequences are preempted (engine/kv_sizing.py). Elsewhere nothing."""
        self._run_on_engine(lambda: kv_sizing.fit(self, floor))

    def add_adapter(self, name: str, base: str, adapter: LoraAdapter) -> None:
        """Serve LoRA ``adapter`` as model ``name`` on loaded model ``base`` (engine/adapters.py)."""
        self._run_on_engine(lambda: adapters.attach(self, name, base, adapter))

    def remove_adapter(self, name: str) -> None:
        self._run_on_engine(lambda: adapters.detach(self, name))

    def set_share_weight(self, name: str, share_weight: float) -> None:
        """Change a loaded model's share of engine steps (live; applied before the next step, not awaited)."""
        if not share_weight > 0:
            raise ValueError(f"share weight must be > 0, got {share_weight!r}")

        def apply():
            if name in self.models:
                self.models[name].share_weight = share_weight

        self._post(apply)

    def _post(self, fn) -> None:
        """Run ``fn`` on the engine thread before its next step, not waiting for it (at once if not started)."""
        if self.alive():
            self._inbox.put(Call(fn, Future()))
        else:
            fn()
            self.flush()

    def set_tenants(self, policies: list[TenantPolicy]) -> None:
        """Replace the tenant policies before the next step (live: running requests keep their blocks)."""
        by_name = {p.name: p for p in policies}
        self.tenant_policies = by_name  # what request() checks limits against, on the caller's side
        self._post(lambda: setattr(self.ledger, "policies", by_name))

    def tenant_stats(self) -> dict[str, TenantStats]:
        """Per-tenant use, as of the latest snapshot."""
        return self.snapshot.tenants

    def submit(self, request: GenerationRequest, on_output: Callable[[RequestOutput], None]) -> str:
        """Queue ``request`` (its limits fixed by request.check_request); ``on_output`` gets its outputs on
        the engine thread. KeyError if its model is not loaded; ValueError if its grammar does not compile."""
        base, adapter = adapters.resolve(self, request.model)
        resident = self.models.get(base)
        if resident is None:
            raise KeyError(f"model {request.model!r} is not loaded")
        seq = new_sequence(resident.loaded, replace(request, model=base), on_output)
        seq.adapter = adapter
        self._put_work(AddSequence(seq))
        return seq.request_id

    def request(self, model_name: str, prompt_ids: list[int], params: SamplingParams, tenant: str = DEFAULT_TENANT,
                priority: str | None = None, clip: bool = False, fair_group: str = "") -> GenerationRequest:
        """A checked request for a loaded model (request.check_request against this engine's latest
        snapshot): what the offline API and in-process callers submit. ValueError says what is wrong."""
        params.validate()
        model, tenant_bytes = self._limits(model_name, tenant)
        limits = check_request(prompt_ids, params, model, tenant_limit_bytes=tenant_bytes, tenant=tenant,
                               priority=priority, clip=clip)
        if params.max_tokens != limits.max_tokens:
            params = replace(params, max_tokens=limits.max_tokens)
        return GenerationRequest(model_name, list(prompt_ids), params, tenant, priority, fair_group=fair_group)

    def embed_request(self, model_name: str, inputs: list[list[int]], tenant: str = DEFAULT_TENANT) -> EmbedRequest:
        """A checked embedding request for a loaded model (request.check_embed); ValueError says what is wrong."""
        check_embed(inputs, *self._limits(model_name, tenant), tenant)
        return EmbedRequest(model_name, [list(ids) for ids in inputs], tenant)

    def _limits(self, model_name: str, tenant: str):
        """(the model's ModelLimits, the tenant's kv_limit in bytes), from the latest snapshot."""
        model_name = adapters.resolve(self, model_name)[0]
        resident = self.models.get(model_name) or self.encoders.get(model_name)
        stats = self.snapshot.stats.models.get(model_name)
        if resident is None or stats is None:
            raise KeyError(f"model {model_name!r} is not loaded")
        config = resident.loaded.config
        limits = model_limits(config.context_length, config.vocab_size, stats, self.config.max_num_seqs)
        return limits, tenant_limit_bytes(self.tenant_policies, tenant, limits)

    def cancel(self, request_id: str) -> None:
        self._inbox.put(Cancel(request_id))

    def embed(self, request: EmbedRequest) -> Future:
        """A future of one vector per input (Vectors; for task "score", a list of one relevance score per
        input); fails with KVCacheBusy when the KV a decoder needs is held. Cancelling the future drops its
        inputs not yet run."""
        if request.model not in self.models and request.model not in self.encoders:
            raise KeyError(f"model {request.model!r} is not loaded")
        future: Future = Future()
        self._put_work(EmbedInputs(PendingEmbed(request.request_id, request.model, request.tenant, request.inputs,
                                                request.type_ids, request.task, future, request.dimensions)))
        return future

    def _put_work(self, item) -> None:
        with self._inbox_lock:
            if self.failure is not None:
                raise EngineFailed(self.failure)
            self._inbox.put(item)

    def has_work(self, model_name: str | None = None) -> bool:
        """Whether the model (or any) had requests running or waiting, as of the latest snapshot."""
        return has_work(self.snapshot.stats, model_name)

    def stats(self) -> EngineStats:
        """Per-model batches and KV use, as of the latest snapshot."""
        return self.snapshot.stats

    # ---- engine thread -------------------------------------------------------------------
    def _run_on_engine(self, fn):
        if threading.current_thread() is self._thread:
            return fn()
        if not self.alive():
            try:
                return fn()
            finally:
                self.flush()
        future: Future = Future()
        self._inbox.put(Call(fn, future))
        return future.result()

    def _loop(self) -> None:
        self.thread_native_id = threading.get_native_id()
        if self.config.cpus:
            # Before torch's first parallel region here, so its pool inherits the mask.
            os.sched_setaffinity(0, self.config.cpus)
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        if self.config.device.startswith("cuda:"):  # one of the process's GPUs (a tensor-parallel rank's, or
            # engine.isolation: thread's): kernels and streams here
            torch.cuda.set_device(self.config.device)
        self._pinned.set()
        while not self._stopping:
            try:
                self.last_tick_s = time.monotonic()
                self._drain_inbox(block=self._pick_model() is None and not self.embeds.pending)
                self.embeds.run_batch(self.models, self.encoders, self.config.max_num_batched_tokens)
                run_urgent_prompts(self)
                resident = self._pick_model()
                if resident is not None:
                    schedule_and_run(self, resident)
                self._shed_idle()
                if resident is None or self.step_outputs.outputs:  # a step flushed already
                    self.flush()
            except Exception as e:
                log.exception("the engine loop failed; it stops and fails every pending request")
                self._fail_everything(f"the engine stopped after an internal error ({type(e).__name__}: {e})")
                return

    def flush(self, after_step: bool = False) -> None:
        """On the engine thread: publish a new snapshot, then deliver the outputs made since the last
        flush, so whoever gets a request's last output sees state that already includes its end.
        Other threads and processes read only snapshots, never the engine's live state.

        ``after_step``: a step's own flush, which publishes only when a request ended or got its first
        token, or the latest snapshot is SNAPSHOT_INTERVAL_S old. A snapshot a step (every ~6 ms at batch 1) cost the worker
        and the supervisor a pickled message each, on the cores the step runs on, for counts that no
        reader needs that fresh."""
        now_s = time.monotonic()
        if (not after_step or now_s - self._snapshot_s >= SNAPSHOT_INTERVAL_S
                or any(out.finished or len(seq.output_ids) <= 1 for seq, out in self.step_outputs.outputs)):
            self._snapshot_s = now_s
            residents = list(self.models.values())
            self.snapshot = EngineSnapshot(engine_stats(self),
                                           tenant_stats(self.ledger, [w.scheduler for w in residents]),
                                           self.last_tick_s, self.failure)
            if self.on_snapshot is not None:
                self.on_snapshot(self.snapshot)
        self.step_outputs.deliver()

    def _borrow(self, requester: Scheduler) -> bool:
        """Scheduler.borrow: preempt another model's sequence for ``requester`` (kv_sharing.py)."""
        residents = list(self.models.values())
        found = borrow_victim(requester, [w.scheduler for w in residents], [w.share_weight for w in residents])
        if found is None:
            return False
        lender, seq = found
        lender.preempt(seq)
        return True

    def _shed_idle(self) -> None:
        now_s = time.monotonic()
        if now_s < self._next_shed_check_s:
            return
        self._next_shed_check_s = now_s + self.config.idle_tick_s
        if self._kv_fit_pending:
            self._kv_fit_pending = not kv_sizing.fit(self, force=False)
        schedulers = [w.scheduler for w in self.models.values()]
        if shed_idle_models(schedulers, self._idle_since_s, now_s, self.config.kv_idle_release_s):
            return_freed_memory()

    def _fail_everything(self, reason: str) -> None:
        """End every pending request with ``reason`` and refuse new ones (the loop is about to exit)."""
        with self._inbox_lock:
            self.failure = reason
        for resident in list(self.models.values()):
            for seq in list(resident.scheduler.running) + list(resident.scheduler.waiting):
                self.step_outputs.fail(seq, reason)
        for seq in list(self.requests.values()):  # taken in but never scheduled
            self.step_outputs.fail(seq, reason)
        items, self._deferred = self._deferred, []
        while not self._inbox.empty():
            items.append(self._inbox.get_nowait())
        for item in items:
            refuse(item, reason, self.step_outputs)
        self.embeds.fail(EngineFailed(reason))
        self.flush()

    def _drain_inbox(self, block: bool) -> None:
        self.new_work.clear()
        deferred, self._deferred = self._deferred, []
        for item in deferred:
            self._handle(item)
        if deferred:
            block = False
        try:
            item = self._inbox.get(timeout=self.config.idle_tick_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item) -> None:
        try:
            handle_item(self, item)
        except Exception as e:  # the item's own request fails, not the loop
            log.exception("engine: handling a %s failed", type(item).__name__)
            if isinstance(item, AddSequence):
                self.requests.pop(item.seq.request_id, None)
            refuse(item, f"the engine could not take this request in: {type(e).__name__}: {e}", self.step_outputs)

    def _pick_model(self) -> ResidentModel | None:
        busy = [w for w in self.models.values() if w.scheduler.has_work()]
        return min(busy, key=lambda w: w.virtual_steps, default=None)

    def take_new_work(self) -> None:
        """Between two layers of a step: take new requests in and run urgent prompts now. Everything
        else (cancels, calls) waits for the step's end, since it could free blocks the paused step
        still writes to."""
        self.new_work.clear()
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, AddSequence):
                self._handle(item)
            else:
                self._deferred.append(item)
        run_urgent_prompts(self)
