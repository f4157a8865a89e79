"""Tenants inside the engine: KV limits and reservations, weighted fair share, prefix caching."""

import threading

import pytest
import torch

from gpushare import SamplingParams
from gpushare.engine.engine import Engine, EngineConfig
from gpushare.engine.kv_pool import kv_bytes_per_block
from gpushare.protocol.request import EmbedRequest, KVCacheBusy
from gpushare.protocol.tenant_policy import TenantPolicy
from daemon_fixture import wait_for
from test_engine import chat_ids

SYSTEM = ("You are a meticulous assistant for a shipping company. Answer questions about parcels, "
          "delivery windows, customs forms, insurance, returns and damaged goods. Be brief, polite and exact. "
          "Never invent tracking numbers; if one is missing, ask for it. Quote prices in euros. ") * 2


def make_engine(llm, num_blocks, start=True, **config):
    """An engine over the session's weights; ``start=False`` leaves it stopped, so that requests can
    be queued first and its first step sees them all, whatever the threads' timing."""
    per_block = kv_bytes_per_block(llm.model.config, config.get("block_size", 16), torch.float32)
    engine = Engine(EngineConfig(kv_dtype="float32", kv_slab_blocks=1, kv_cache_bytes=num_blocks * per_block, **config))
    engine.add_model("m", llm.model)
    if start:
        engine.start()
    return engine, per_block


class Requests:
    """Submit requests and wait for all of them; records each one's tokens and finish reason."""

    def __init__(self, engine):
        self.engine, self.results, self.lock = engine, {}, threading.Lock()
        self.pending = 0
        self.all_done = threading.Event()

    def submit(self, ids, params, tenant, key=None):
        key = key if key is not None else len(self.results) + self.pending
        tokens = []
        with self.lock:
            self.pending += 1
            self.all_done.clear()

        def on_output(out):
            tokens.extend(out.token_ids)
            if out.finished:
                with self.lock:
                    self.results[key] = (tokens, out.finish_reason)
                    self.pending -= 1
                    if self.pending == 0:
                        self.all_done.set()
        self.engine.submit(self.engine.request("m", ids, params, tenant=tenant), on_output)
        return key

    def wait(self, timeout_s=300):
        assert self.all_done.wait(timeout_s), "requests did not finish"
        return self.results


def conv_ids(llm, question, system=None):
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return llm.tokenizer.encode(llm.model.render_chat(messages))


def test_flooding_tenant_never_exceeds_its_kv_limit(llm):
    limit_blocks = 10
    engine, per_block = make_engine(llm, 40, start=False)
    engine.set_tenants([TenantPolicy("flood", kv_limit_bytes=limit_blocks * per_block), TenantPolicy("calm")])
    peaks = []

    def invariant(eng):
        used = eng.ledger.used_bytes.get("flood", 0)
        peaks.append(used)
        assert used <= limit_blocks * per_block

    engine.on_step = invariant
    try:
        reqs = Requests(engine)
        for i in range(5):  # ~5 blocks each by their end: never more than two fit the limit at once
            reqs.submit(chat_ids(llm, f"Write a story number {i} about a fox."),
                        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), "flood")
        reqs.submit(chat_ids(llm, "Hello!"), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), "calm")
        engine.start()
        results = reqs.wait()
        assert engine.stats().models["m"].blocks_used == 0
        assert engine.stats().models["m"].preemptions > 0  # the flooder waited on itself
    finally:
        engine.shutdown()
    assert all(reason == "length" for _, reason in results.values())
    assert max(peaks) == limit_blocks * per_block


def test_request_beyond_the_tenant_limit_is_refused(llm):
    engine, per_block = make_engine(llm, 40)
    engine.set_tenants([TenantPolicy("small", kv_limit_bytes=2 * per_block)])
    try:
        with pytest.raises(ValueError, match="kv_limit"):
            engine.submit(engine.request("m", chat_ids(llm, "Hi"), SamplingParams(max_tokens=64), tenant="small"), lambda out: None)
    finally:
        engine.shutdown()


def test_embedding_inputs_are_charged_to_their_tenant(llm):
    engine, per_block = make_engine(llm, 40)
    engine.set_tenants([TenantPolicy("tiny", kv_limit_bytes=2 * per_block), TenantPolicy("calm")])
    ids = conv_ids(llm, "Summarise: " + "the river runs to the sea and the sea never fills; " * 4)
    assert len(ids) > 2 * 16
    charged_during_forward = []

    def record(module, args, output):
        charged_during_forward.append(dict(engine.ledger.used_bytes))

    hook = llm.model.model.layers[0].register_forward_hook(record)
    try:
        with pytest.raises(ValueError, match="kv_limit"):
            engine.embed(engine.embed_request("m", [ids], tenant="tiny"))
        (vector,) = engine.embed(EmbedRequest("m", [ids], tenant="calm")).result(timeout=120)
    finally:
        hook.remove()
        engine.shutdown()
    assert len(vector) == llm.model.config.hidden_size
    assert charged_during_forward == [{"calm": -(-len(ids) // 16) * per_block}]
    assert engine.ledger.used_bytes == {"calm": 0}


def test_embedding_never_takes_another_tenants_reservation(llm):
    engine, per_block = make_engine(llm, 10)
    engine.set_tenants([TenantPolicy("owner", kv_reserved_bytes=10 * per_block), TenantPolicy("other")])
    try:
        with pytest.raises(KVCacheBusy, match="no room in the KV cache"):
            engine.embed(EmbedRequest("m", [conv_ids(llm, "hello")], tenant="other")).result(timeout=120)
        assert len(engine.embed(EmbedRequest("m", [conv_ids(llm, "hello")], tenant="owner")).result(timeout=120)[0]) > 0
    finally:
        engine.shutdown()


def test_reservation_is_available_at_once_while_a_flooder_fills_the_rest(llm):
    reserved_blocks = 6
    engine, per_block = make_engine(llm, 30, start=False, max_num_seqs=16)
    engine.set_tenants([TenantPolicy("vip", kv_reserved_bytes=reserved_blocks * per_block), TenantPolicy("flood")])
    flood_waiting_when_vip_ran = []
    reqs = Requests(engine)
    vip, vip_sent = chat_ids(llm, "Hi"), []

    def watch(eng):
        sched = eng.models["m"].scheduler
        if any(s.tenant == "vip" for s in sched.running) and not flood_waiting_when_vip_ran:
            flood_waiting_when_vip_ran.append(sum(s.tenant == "flood" for s in sched.waiting))
        assert sched.pool.tenant_blocks("flood") <= 30 - reserved_blocks
        # The vip arrives (from the engine thread, between two steps) once the flood has filled
        # the rest of the pool and has requests waiting.
        if sched.waiting and not vip_sent:
            vip_sent.append(reqs.submit(vip, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), "vip"))

    engine.on_step = watch
    try:
        for i in range(12):
            reqs.submit(chat_ids(llm, f"Write a long essay number {i} about rivers."),
                        SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), "flood")
        engine.start()
        # the vip's answer is what is measured: the flood's last steps add nothing (~7 s of them)
        assert wait_for(lambda: vip_sent and vip_sent[0] in reqs.results, timeout_s=300), "the vip never finished"
    finally:
        engine.shutdown()
    assert flood_waiting_when_vip_ran and flood_waiting_when_vip_ran[0] > 0


def test_weighted_fair_share_of_computed_tokens(llm):
    # Every request is queued before the engine starts, so the measured window does not depend on
    # how the submissions interleave with the first steps.
    per_block = kv_bytes_per_block(llm.model.config, 16, torch.float32)
    engine = Engine(EngineConfig(max_num_seqs=4, prefix_cache="off", kv_dtype="float32",
                                 kv_cache_bytes=200 * per_block))
    engine.add_model("m", llm.model)
    engine.set_tenants([TenantPolicy("light", weight=1), TenantPolicy("heavy", weight=3)])
    window, closed = [], threading.Event()

    def watch(eng):
        sched = eng.models["m"].scheduler
        waiting = {s.tenant for s in sched.waiting}
        if {"light", "heavy"} <= waiting:
            window.append((eng.ledger.computed_tokens.get("light", 0), eng.ledger.computed_tokens.get("heavy", 0)))
        elif window:
            closed.set()  # one tenant's queue is empty: what is left is no contest

    engine.on_step = watch
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    try:
        reqs = Requests(engine)
        for i in range(40):
            reqs.submit(chat_ids(llm, f"Question {i}: name a city."), params, "light")
            reqs.submit(chat_ids(llm, f"Question {i}: name a river."), params, "heavy")
        engine.start()
        assert closed.wait(300), "the two tenants' queues never emptied"
    finally:
        engine.shutdown()
    (light0, heavy0), (light1, heavy1) = window[0], window[-1]
    share = (light1 - light0) / ((light1 - light0) + (heavy1 - heavy0))
    assert abs(share - 0.25) <= 0.025, f"light tenant got {share:.1%} of computed tokens, expected 25%"


def test_prefix_cache_reused_within_a_tenant_never_across(llm):
    engine, _ = make_engine(llm, 200, prefix_cache="tenant")
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    try:
        first = conv_ids(llm, "Where is my parcel?", SYSTEM)
        reqs = Requests(engine)
        reqs.submit(first, greedy, "a")
        reqs.wait()
        before = dict(engine.ledger.computed_tokens)
        reqs = Requests(engine)
        second = conv_ids(llm, "How do I return a damaged vase?", SYSTEM)
        reqs.submit(second, greedy, "a")
        reqs.wait()
        hits_a = engine.ledger.prefix_hit_tokens.get("a", 0)
        computed_a = engine.ledger.computed_tokens["a"] - before["a"]
        reqs = Requests(engine)
        reqs.submit(second, greedy, "b")
        reqs.wait()
    finally:
        engine.shutdown()
    shared = len(conv_ids(llm, "x", SYSTEM)) - 8  # the system turn and the template's head are common
    assert hits_a >= shared // 16 * 16 - 16 and hits_a >= 64
    assert computed_a <= len(second) - hits_a + 4  # prompt tail plus the 4 decode steps
    assert engine.ledger.prefix_hit_tokens.get("b", 0) == 0


def test_global_scope_shares_across_tenants(llm):
    engine, _ = make_engine(llm, 200, prefix_cache="global")
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    try:
        for tenant in ("a", "b"):
            reqs = Requests(engine)
            reqs.submit(conv_ids(llm, f"Question from {tenant}", SYSTEM), greedy, tenant)
            reqs.wait()
    finally:
        engine.shutdown()
    assert engine.ledger.prefix_hit_tokens.get("b", 0) >= 64


def test_greedy_outputs_unchanged_by_prefix_caching(llm):
    questions = ["Where is my parcel?", "Can I insure a painting?", "How long does customs take?"]
    outputs = {}
    for scope in ("off", "tenant"):
        engine, _ = make_engine(llm, 200, prefix_cache=scope)
        try:
            tokens = []
            for q in questions:  # one after another, so later ones can hit the cache
                reqs = Requests(engine)
                reqs.submit(conv_ids(llm, q, SYSTEM), SamplingParams(temperature=0, max_tokens=12), "a")
                tokens.append(reqs.wait()[0][0])
            outputs[scope] = tokens
            hits = engine.ledger.prefix_hit_tokens.get("a", 0)
        finally:
            engine.shutdown()
        assert (hits > 0) == (scope == "tenant")
    assert outputs["tenant"] == outputs["off"]
