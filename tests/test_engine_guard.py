"""One request's failure stays its own: sampling rows, per-sequence work and the engine loop, on the real model.

Accepted parameters can no longer make a row fail (their ranges are bounded), so the tests that
need a failing row or a failing loop make one on purpose: a row's parameters changed after the
request was validated, a bug injected into one sequence's text step, the engine's `on_step` hook
raising. Everything else is the real engine and the real SmolLM2.
"""

import threading

import pytest
import torch

from gpushare import SamplingParams
from gpushare.engine import step_outputs as step_outputs_module
from gpushare.protocol.request import EmbedRequest, EngineFailed
from gpushare.engine.sampling import sample
from gpushare.protocol.sampling_params import SamplingFailure
from test_engine import PROMPTS, chat_ids, greedy, small_engine


def collect_into(results: dict, key, done: threading.Event, expected: int):
    def on_output(out):
        ids, _, _ = results.setdefault(key, ([], [None], [None]))
        ids.extend(out.token_ids)
        if out.finished:
            results[key] = (ids, out.finish_reason, out.error)
            if len(results) == expected and all(len(r) == 3 and not isinstance(r[1], list) for r in results.values()):
                done.set()
    return on_output


def run(engine, llm, prompts, params_list, before_start=None):
    """Submit each prompt with its params; returns {index: (token ids, finish reason, error)}."""
    results, done = {}, threading.Event()
    for i, (prompt, params) in enumerate(zip(prompts, params_list)):
        engine.submit(engine.request("m", chat_ids(llm, prompt), params), collect_into(results, i, done, len(prompts)))
    if before_start is not None:
        before_start()
    engine.start()  # once every request is queued: the first step sees them all
    assert done.wait(300), f"not every request finished: {results}"
    return results


def test_near_zero_temperature_is_greedy(llm):
    conv = [{"role": "user", "content": PROMPTS[1]}]
    expected = llm.chat([conv], greedy(12))[0].token_ids
    tiny = llm.chat([conv], SamplingParams(temperature=1e-40, max_tokens=12, ignore_eos=True))[0]
    assert tiny.token_ids == expected


@pytest.mark.parametrize("field, value, message", [
    ("repetition_penalty", 1e-40, r"repetition_penalty must be in \[0.01, 100\]"),
    ("repetition_penalty", float("inf"), r"repetition_penalty must be in \[0.01, 100\]"),
    ("temperature", float("inf"), r"temperature must be in \[0, 100\]"),
    ("seed", 1 << 64, r"seed must be an integer in \[-2\*\*63, 2\*\*64 - 1\]"),
])
def test_out_of_range_values_are_refused(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value}).validate()


def test_a_row_that_cannot_be_sampled_fails_alone(llm):
    ids = chat_ids(llm, PROMPTS[0])
    logits = torch.randn(3, llm.model.config.vocab_size, generator=torch.Generator().manual_seed(5)) * 5
    seeded = SamplingParams(temperature=0.9, seed=3)
    broken = SamplingParams(temperature=1.0, repetition_penalty=1e-40)  # never validated: a stand-in for any bad row
    rows = [(seeded, ids, [], torch.Generator().manual_seed(3)),
            (broken, ids, [], None),
            (SamplingParams(temperature=1e-30), ids, [], None)]
    tokens = sample(logits, rows)
    assert isinstance(tokens[1], SamplingFailure) and "sampling failed" in tokens[1].message
    alone = sample(logits[:1], [(seeded, ids, [], torch.Generator().manual_seed(3))])
    assert tokens[0] == alone[0]
    assert tokens[2] == int(logits[2].argmax())


def test_a_failing_row_ends_its_request_and_the_batch_goes_on(llm):
    reference = [llm.chat([[{"role": "user", "content": p}]], greedy(16))[0].token_ids for p in PROMPTS[:2]]
    engine = small_engine(llm, num_blocks=64)
    broken = SamplingParams(temperature=1.0, max_tokens=16)
    try:
        # Changed after its validation, as if a bad value had passed it: every row of it fails.
        results = run(engine, llm, [PROMPTS[0], PROMPTS[2], PROMPTS[1]], [greedy(16), broken, greedy(16)],
                      before_start=lambda: setattr(broken, "repetition_penalty", 1e-40))
        assert engine.stats().models["m"].blocks_used == 0
    finally:
        engine.shutdown()
    assert results[1][1] == "error" and "sampling failed" in results[1][2]
    assert [results[0][:2], results[2][:2]] == [(reference[0], "length"), (reference[1], "length")]


def test_a_failure_after_the_step_ends_only_that_request(llm, monkeypatch):
    reference = llm.chat([[{"role": "user", "content": PROMPTS[0]}]], greedy(16))[0].token_ids
    engine = small_engine(llm, num_blocks=64)
    doomed = []
    real_append_text = step_outputs_module.append_text

    def append_text(tokenizer, seq):  # an injected bug that hits one sequence
        if seq.request_id in doomed and len(seq.output_ids) == 3:
            raise RuntimeError("injected detokenizer bug")
        return real_append_text(tokenizer, seq)

    monkeypatch.setattr(step_outputs_module, "append_text", append_text)
    try:
        results, done = {}, threading.Event()
        engine.submit(engine.request("m", chat_ids(llm, PROMPTS[0]), greedy(16)), collect_into(results, 0, done, 2))
        doomed.append(engine.submit(engine.request("m", chat_ids(llm, PROMPTS[1]), greedy(16)), collect_into(results, 1, done, 2)))
        engine.start()
        assert done.wait(300)
        assert engine.alive() and engine.stats().models["m"].blocks_used == 0
    finally:
        engine.shutdown()
    assert results[1][1] == "error" and "injected detokenizer bug" in results[1][2]
    assert results[0][:2] == (reference, "length")


def test_a_failed_loop_ends_every_stream_and_refuses_new_work(llm):
    engine = small_engine(llm, num_blocks=64)

    def on_step(_engine):
        raise RuntimeError("injected loop bug")

    try:
        engine.on_step = on_step
        results = run(engine, llm, PROMPTS[:3], [greedy(16)] * 3)
        engine._thread.join(30)  # the loop ends right after it has ended the streams
        assert not engine.alive()
        assert "injected loop bug" in engine.failure
        assert {r[1] for r in results.values()} == {"error"}
        assert all("injected loop bug" in r[2] for r in results.values())
        with pytest.raises(EngineFailed, match="injected loop bug"):
            engine.submit(engine.request("m", chat_ids(llm, PROMPTS[0]), greedy(4)), lambda out: None)
        with pytest.raises(EngineFailed):
            engine.embed(EmbedRequest("m", [chat_ids(llm, PROMPTS[0])]))
    finally:
        engine.shutdown()


def test_generation_steps_run_between_the_batches_of_a_large_embedding(llm):
    inputs = [chat_ids(llm, p) for p in PROMPTS]
    # A step's token budget below any two inputs: each input is a batch of its own.
    budget = 2 * min(map(len, inputs)) - 1
    assert budget >= max(map(len, inputs))
    engine = small_engine(llm, num_blocks=128, max_num_batched_tokens=budget)
    engine.start()
    try:
        first_token, finished = threading.Event(), threading.Event()

        def on_output(out):
            first_token.set()
            if out.finished:
                finished.set()

        engine.submit(engine.request("m", chat_ids(llm, PROMPTS[0]), greedy(64)), on_output)
        assert first_token.wait(120)
        steps_before = engine.steps
        future = engine.embed(EmbedRequest("m", inputs))
        steps_at_end = []
        future.add_done_callback(lambda f: steps_at_end.append(engine.steps))  # runs on the engine thread
        assert len(future.result(timeout=300)) == len(inputs)
        assert finished.wait(300)
    finally:
        engine.shutdown()
    # One embedding batch per loop turn: the running generation took a step between each two of them.
    assert steps_at_end[0] - steps_before >= len(inputs) - 1
