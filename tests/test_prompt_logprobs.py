"""SamplingParams(prompt_logprobs=k) in the offline API against transformers, on the real SmolLM2 GGUF."""

import pytest
import torch

from gpushare import LLM, SamplingParams
from gpushare.engine.kv_pool import kv_bytes_per_block

TEXT = ("Four score and seven years ago our fathers brought forth on this continent, a new nation, conceived in "
        "Liberty, and dedicated to the proposition that all men are created equal. Now we are engaged in a great "
        "civil war, testing whether that nation, or any nation so conceived and so dedicated, can long endure.")
TOLERANCE = 2e-4  # nats; float32 on both sides, the same dequantised weights (measured: 3e-5)


@pytest.fixture(scope="module")
def prompt_ids(llm):
    return llm.tokenizer.encode(TEXT, add_special_tokens=True)


@pytest.fixture(scope="module")
def expected(hf_model, prompt_ids):
    """transformers' log_softmax over its float32 logits: row p scores prompt token p + 1."""
    model, _ = hf_model
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.fixture(scope="module")
def chunked_llm(smollm2_path):
    """Prompts run over several engine steps: 16 tokens per step."""
    model = LLM(smollm2_path, dtype="float32", weights="float32", kv_dtype="float32", num_threads=2,
                max_num_batched_tokens=16, kv_cache_bytes=64 << 20)
    yield model
    model.shutdown()


def params(k=0):
    return SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k)


def assert_matches(prompt_logprobs, prompt_ids, expected):
    assert len(prompt_logprobs) == len(prompt_ids)
    assert prompt_logprobs[0] is None
    worst = 0.0
    for position, (entry, token) in enumerate(zip(prompt_logprobs[1:], prompt_ids[1:]), start=1):
        assert token in entry, f"position {position}: the prompt token {token} is missing"
        worst = max(worst, abs(entry[token] - float(expected[position - 1, token])))
    assert worst < TOLERANCE, f"largest logprob difference {worst:.2e}"


def test_prompt_logprobs_match_transformers(llm, prompt_ids, expected):
    [out] = llm.generate([prompt_ids], params())
    assert len(prompt_ids) > 40
    assert_matches(out.prompt_logprobs, prompt_ids, expected)
    assert all(len(entry) == 1 for entry in out.prompt_logprobs[1:])


def test_prompt_logprobs_over_several_chunks(chunked_llm, prompt_ids, expected):
    # Two prompts at once: the second starts in the step that ends the first (37 = 2 * 16 + 5), so
    # that step's rows mix both. A prefix of the prompt has the prompt's own first rows as its answer.
    first = prompt_ids[:37]
    outs = chunked_llm.generate([first, prompt_ids], params())
    assert len(prompt_ids) > 3 * 16
    assert_matches(outs[0].prompt_logprobs, first, expected)
    assert_matches(outs[1].prompt_logprobs, prompt_ids, expected)


def test_prompt_logprobs_survive_preemption(llm, smollm2_path, prompt_ids, expected):
    # Six 16-token blocks: a 32-token prompt generating 48 tokens (5 blocks at the end) leaves too
    # little for the long prompt (4 blocks), which is preempted mid-prefill and recomputed later.
    per_block = kv_bytes_per_block(llm.model.config, 16, torch.float32)
    tight = LLM(smollm2_path, dtype="float32", weights="float32", kv_dtype="float32", num_threads=2,
                max_num_batched_tokens=16, kv_cache_bytes=6 * per_block)
    try:
        outs = tight.generate([prompt_ids[-32:], prompt_ids],
                              [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), params()])
        assert tight.engine.stats().models[tight.model_name].preemptions > 0
    finally:
        tight.shutdown()
    assert_matches(outs[1].prompt_logprobs, prompt_ids, expected)


def test_top_k_entries_are_transformers_most_likely_tokens(llm, prompt_ids, expected):
    [out] = llm.generate([prompt_ids], params(k=5))
    assert_matches(out.prompt_logprobs, prompt_ids, expected)
    for position, (entry, token) in enumerate(zip(out.prompt_logprobs[1:], prompt_ids[1:]), start=1):
        top = torch.topk(expected[position - 1], 5)
        assert set(entry) == set(top.indices.tolist()) | {token}
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(entry[t] - v) < TOLERANCE


def test_cached_prefix_is_scored_too(llm, prompt_ids, expected):
    # The first run leaves the prompt's full blocks in the prefix cache; the second must still score them.
    llm.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=1))
    [out] = llm.generate([prompt_ids], params())
    assert_matches(out.prompt_logprobs, prompt_ids, expected)


def test_only_the_sequence_that_asked_gets_prompt_logprobs(llm, prompt_ids):
    plain = SamplingParams(temperature=0, max_tokens=4)
    asked = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0)
    both = llm.generate([prompt_ids, prompt_ids], [plain, asked])
    assert both[0].prompt_logprobs is None
    assert len(both[1].prompt_logprobs) == len(prompt_ids)
    assert both[0].token_ids == both[1].token_ids


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True, "3"])
def test_bad_prompt_logprobs_is_refused(llm, bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate(["hello"], SamplingParams(prompt_logprobs=bad))
