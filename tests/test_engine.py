"""The engine on the real model: batching, chunked prefill, preemption, cancellation, bad input."""

import threading
import time

import pytest
import torch

from gpushare import SamplingParams
from gpushare.engine.engine import Engine, EngineConfig
from gpushare.engine.kv_pool import kv_bytes_per_block

PROMPTS = [
    "Tell me a story about a dragon.",
    "How do airplanes fly?",
    "List five fruits and their colors.",
    "What is machine learning?",
    "Describe the water cycle.",
    "Write a short poem about autumn leaves.",
]


def greedy(n=32):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def small_engine(llm, num_blocks, **config):
    """A second engine over the already-loaded weights, with a pool of ``num_blocks`` blocks; not
    started (``run_all`` starts it once every request is queued)."""
    per_block = kv_bytes_per_block(llm.model.config, config.get("block_size", 16), torch.float32)
    engine = Engine(EngineConfig(kv_dtype="float32", kv_slab_blocks=1, kv_cache_bytes=num_blocks * per_block, **config))
    engine.add_model("m", llm.model)
    return engine


def run_all(engine, token_lists, params):
    """Queue everything, then start the engine, so its first step sees every request whatever the
    threads' timing; returns each request's (token_ids, finish_reason, streamed texts, error)."""
    results = {}
    done = threading.Event()

    def collector(i):
        ids, texts = [], []

        def on_output(out):
            ids.extend(out.token_ids)
            texts.append(out.text)
            if out.finished:
                results[i] = (ids, out.finish_reason, texts, out.error)
                if len(results) == len(token_lists):
                    done.set()
        return on_output

    for i, tokens in enumerate(token_lists):
        engine.submit(engine.request("m", tokens, params), collector(i))
    engine.start()
    assert done.wait(300), "engine did not finish"
    return [results[i] for i in range(len(token_lists))]


def chat_ids(llm, prompt):
    return llm.tokenizer.encode(llm.model.render_chat([{"role": "user", "content": prompt}]))


@pytest.fixture(autouse=True)
def all_blocks_returned(llm):
    yield
    for name, stats in llm.engine.stats().models.items():
        assert stats.blocks_used == 0, f"{name} leaked {stats.blocks_used} KV blocks"


@pytest.fixture(scope="module")
def reference(llm):
    """Greedy outputs with a roomy pool, in one batch (the exact path answers alone and batched alike:
    test_oracle's one-at-a-time and all-in-one-call tests; one at a time took ~12 s)."""
    return [out.token_ids for out in llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], greedy())]


def test_preemption_keeps_greedy_outputs(llm, reference):
    # 6 requests of ~40 + 32 tokens need ~30 blocks; 12 blocks force preemption and recompute.
    engine = small_engine(llm, num_blocks=12)
    try:
        results = run_all(engine, [chat_ids(llm, p) for p in PROMPTS], greedy())
        stats = engine.stats().models["m"]
        assert stats.preemptions > 0
        assert stats.blocks_used == 0
    finally:
        engine.shutdown()
    assert [r[0] for r in results] == reference


def test_chunked_prefill_keeps_greedy_outputs(llm, reference):
    engine = small_engine(llm, num_blocks=64, max_num_batched_tokens=16, max_num_seqs=3)
    try:
        results = run_all(engine, [chat_ids(llm, p) for p in PROMPTS], greedy())
        assert engine.stats().models["m"].blocks_used == 0
    finally:
        engine.shutdown()
    assert [r[0] for r in results] == reference


def test_cancel_frees_blocks_and_ends_stream(llm):
    engine = small_engine(llm, num_blocks=64)
    engine.start()
    try:
        seen = []
        finished = threading.Event()

        def on_output(out):
            seen.append(out)
            if out.finished:
                finished.set()
            elif len(seen) == 3:
                engine.cancel(out.request_id)

        engine.submit(engine.request("m", chat_ids(llm, PROMPTS[0]), greedy(200)), on_output)
        assert finished.wait(60)
        assert seen[-1].finish_reason == "abort"
        assert len(seen) < 200
        assert engine.stats().models["m"].blocks_used == 0
    finally:
        engine.shutdown()


def test_same_seed_same_text_whatever_the_batch(llm):
    conv = [{"role": "user", "content": "Invent a name for a new color."}]
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24)
    alone = llm.chat([conv], params)[0].text
    crowd = [[{"role": "user", "content": p}] for p in PROMPTS[:3]]
    mixed = llm.chat([crowd[0], conv, crowd[1], crowd[2]],
                     [SamplingParams(temperature=1.0, max_tokens=24), params,
                      SamplingParams(temperature=1.0, max_tokens=24), greedy(8)])
    assert mixed[1].text == alone
    other_seed = llm.chat([conv], SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99, max_tokens=24))
    assert other_seed[0].text != alone


def test_stop_string_is_not_emitted(llm):
    conv = [{"role": "user", "content": PROMPTS[0]}]
    full = llm.chat([conv], greedy(40))[0].text
    stop = next(w for w in full.split()[5:] if len(w) >= 5)
    out = llm.chat([conv], SamplingParams(temperature=0, max_tokens=40, stop=["zzzz", stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[:full.index(stop)]


def test_max_tokens_gives_length_and_eos_gives_stop(llm):
    conv = [{"role": "user", "content": "Say hello."}]
    short = llm.chat([conv], SamplingParams(temperature=0, max_tokens=3))[0]
    assert short.finish_reason == "length" and len(short.token_ids) == 3
    full = llm.chat([conv], SamplingParams(temperature=0, max_tokens=200))[0]
    assert full.finish_reason == "stop"
    assert full.token_ids[-1] in llm.model.stop_token_ids


def test_streamed_text_never_splits_a_character(llm):
    engine = small_engine(llm, num_blocks=64)
    try:
        prompt = chat_ids(llm, "Reply with three emoji and the word café in Japanese: 日本語.")
        [(ids, _, texts, _)] = run_all(engine, [prompt], SamplingParams(temperature=0.8, seed=7, max_tokens=48))
    finally:
        engine.shutdown()
    assert all("\ufffd" not in t for t in texts)
    assert "".join(texts) == llm.tokenizer.decode([t for t in ids if t not in llm.model.stop_token_ids])


def test_bad_inputs_raise_and_engine_keeps_serving(llm, tmp_path):
    from gpushare import LLM

    conv = [{"role": "user", "content": "Hi"}]
    with pytest.raises(ValueError, match="empty"):
        llm.generate([])
    with pytest.raises(ValueError, match="empty"):
        llm.chat([])
    with pytest.raises(FileNotFoundError, match="not found"):
        LLM(str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="max_tokens"):
        llm.chat([conv], SamplingParams(max_tokens=-1))
    for top_p in (0, 1.5):
        with pytest.raises(ValueError, match="top_p"):
            llm.chat([conv], SamplingParams(top_p=top_p))
    with pytest.raises(ValueError, match="9000 tokens, and the usable context is 8192 tokens"):
        llm.generate([[1] * 9000], greedy(4))
    with pytest.raises(ValueError, match=r"max_tokens \(8100\) exceeds the usable context of 8192 tokens"):
        llm.generate([[1] * 100], SamplingParams(max_tokens=8100))
    assert llm.chat([conv], greedy(4))[0].finish_reason == "length"


def test_request_larger_than_the_pool_fails_at_once(llm):
    engine = small_engine(llm, num_blocks=4)
    try:
        with pytest.raises(ValueError, match=r"exceeds the usable context of 64 tokens \(.*KV pool 64"):
            engine.submit(engine.request("m", chat_ids(llm, PROMPTS[0]), greedy(100)), lambda out: None)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("how", ["truncated", "garbage"])
def test_corrupt_gguf_is_reported(smollm2_path, tmp_path, how):
    from gpushare.models.loader import load_model

    bad = tmp_path / "bad.gguf"
    data = open(smollm2_path, "rb").read(4096 if how == "truncated" else 0)
    bad.write_bytes(data if how == "truncated" else b"not a model at all")
    with pytest.raises(ValueError, match="bad.gguf"):
        load_model(str(bad))


def test_snapshots_while_steps_run_are_throttled_and_a_finished_request_is_in_the_next(llm):
    """A worker sends every snapshot to its supervisor: one a step (every few ms) cost the decode
    steps ~7% at batch 1. While a request generates, snapshots come at most every
    SNAPSHOT_INTERVAL_S; the one published with a request's last output already counts it done."""
    from gpushare.engine.engine import SNAPSHOT_INTERVAL_S

    engine = small_engine(llm, num_blocks=64)
    snapshots, steps = [], []
    engine.on_snapshot = lambda snapshot: snapshots.append(time.monotonic())
    engine.on_step = lambda e: steps.append(e.steps)
    finished = threading.Event()
    seen_at_end = []

    def on_output(out):
        if out.finished:
            seen_at_end.append(engine.snapshot.stats.models["m"])
            finished.set()

    engine.start()
    try:
        started_at, start_s = len(snapshots), time.monotonic()
        engine.submit(engine.request("m", chat_ids(llm, PROMPTS[0]), greedy(96)), on_output)
        assert finished.wait(120)
        elapsed_s, during = time.monotonic() - start_s, snapshots[started_at:]
        assert len(steps) >= 96
        assert len(during) <= elapsed_s / SNAPSHOT_INTERVAL_S + 3, (len(during), len(steps), elapsed_s)
        # published at least an interval apart, but for the last (the request's end)
        assert all(b - a >= SNAPSHOT_INTERVAL_S - 0.005 for a, b in zip(during, during[1:-1])), during
        assert seen_at_end[0].running == 0 and seen_at_end[0].steps == len(steps)
    finally:
        engine.shutdown()
