"""The one request validator (protocol/request.check_request): the max_tokens rule and what it refuses,
naming the field."""

import pytest

from gpushare.protocol.request import ModelLimits, RequestError, check_embed, check_request, usable_context
from gpushare.protocol.sampling_params import SamplingParams

# A model with an 8,192-token context whose device pool holds 4,096 of its tokens, 1 KiB per token.
LIMITS = ModelLimits(vocab_size=100, context_length=8192, pool_tokens=4096, block_size=16, bytes_per_token=1024,
                     max_num_seqs=8)
PROMPT = list(range(10))


def test_no_max_tokens_means_up_to_the_end_of_the_usable_context():
    fixed = check_request(PROMPT, SamplingParams(), LIMITS)
    assert (fixed.context_tokens, fixed.max_tokens) == (4096, 4096 - len(PROMPT))  # the pool is the bound here
    assert check_request(PROMPT, SamplingParams(), LIMITS, num_ctx=100).max_tokens == 90


def test_a_tenant_kv_limit_bounds_the_usable_context_in_whole_blocks():
    assert usable_context(LIMITS, tenant_limit_bytes=1000 * 1024) == 992  # 1,000 tokens, rounded down to blocks
    fixed = check_request(PROMPT, SamplingParams(), LIMITS, tenant_limit_bytes=1000 * 1024)
    assert fixed.max_tokens == 992 - len(PROMPT)


def test_too_many_tokens_asked_are_clipped_or_refused_naming_max_tokens():
    asked = SamplingParams(max_tokens=5000)
    assert check_request(PROMPT, asked, LIMITS, clip=True).max_tokens == 4096 - len(PROMPT)
    with pytest.raises(RequestError) as info:
        check_request(PROMPT, asked, LIMITS)
    assert info.value.field == "max_tokens"
    assert str(info.value) == ("the prompt (10 tokens) plus max_tokens (5000) exceeds the usable context of 4096 "
                               "tokens (the least of model context 8192, KV pool 4096 (memory.kv_budget))")
    assert check_request(PROMPT, SamplingParams(max_tokens=7), LIMITS).max_tokens == 7


@pytest.mark.parametrize("prompt, params, kwargs, field, message", [
    ([], SamplingParams(), {}, "prompt", "the prompt is empty"),
    ([5, 100], SamplingParams(), {}, "prompt", "token ids outside the vocabulary [0, 100)"),
    (list(range(50)) * 100, SamplingParams(), {}, "prompt", "the prompt is 5000 tokens, and the usable context is 4096"),
    (PROMPT, SamplingParams(n=9), {}, "n", "n must be at most engine.max_num_seqs (8), got 9"),
    (PROMPT, SamplingParams(n=8, max_tokens=1000), {}, "n", "n (8) answers of max_tokens (1000) tokens need more KV"),
    (PROMPT, SamplingParams(), {"priority": "urgent"}, "priority", "priority must be one of interactive, batch"),
    (PROMPT, SamplingParams(), {"tenant_limit_bytes": 5 * 1024, "tenant": "tiny"}, "prompt",
     "kv_limit (5 tokens) of tenant 'tiny'"),
])
def test_a_request_that_can_never_run_is_refused_naming_its_field(prompt, params, kwargs, field, message):
    with pytest.raises(RequestError) as info:
        check_request(prompt, params, LIMITS, **kwargs)
    assert info.value.field == field and message in str(info.value)


def test_embedding_inputs_are_checked_one_by_one():
    check_embed([PROMPT, PROMPT], LIMITS)
    with pytest.raises(ValueError, match="input 1 is empty"):
        check_embed([PROMPT, []], LIMITS)
    with pytest.raises(ValueError, match=r"input 0 is 4097 tokens, and the usable context is 4096 tokens"):
        check_embed([[1] * 4097], LIMITS)
