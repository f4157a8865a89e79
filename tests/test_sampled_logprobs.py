"""Logprobs of sampled tokens in the offline API: from the logits the sampler used, after penalties
and before temperature; the offline API refuses n > 1."""

import math

import pytest

from gpushare import SamplingParams

CONV = [{"role": "user", "content": "List three colours, then three colours again."}]


def test_greedy_with_a_penalty_chooses_its_top_logprob(llm):
    """The penalised row picked each token, so each chosen token is its own top-1 (the raw logits'
    top-1 would often be a repeated token instead)."""
    out = llm.chat(CONV, SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.5, logprobs=3))[0]
    assert [lp.token_id for lp in out.logprobs] == out.token_ids[:len(out.logprobs)]
    for lp in out.logprobs:
        best_id, best = lp.top[0]
        assert best_id == lp.token_id and best == lp.logprob
        assert len(lp.top) == 3 and all(v <= best for _, v in lp.top)


def test_temperature_does_not_change_logprobs(llm):
    """Before temperature: the first token's distribution is the same at any temperature."""
    firsts = [llm.chat(CONV, SamplingParams(temperature=t, seed=5, max_tokens=1, logprobs=5))[0].logprobs[0].top
              for t in (0.3, 1.7)]
    assert [i for i, _ in firsts[0]] == [i for i, _ in firsts[1]]
    assert all(math.isclose(a, b, abs_tol=1e-6) for (_, a), (_, b) in zip(*firsts))


def test_no_logprobs_unless_asked(llm):
    assert llm.chat(CONV, SamplingParams(temperature=0, max_tokens=4))[0].logprobs is None


def test_offline_n_is_refused(llm):
    with pytest.raises(ValueError, match="n must be 1 in the offline API"):
        llm.chat(CONV, SamplingParams(n=2))
