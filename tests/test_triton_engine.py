"""The engine with the Triton kernels forced on (under TRITON_INTERPRET=1) matches the torch path.

Slow (~21 s of the interpreter): each Triton kernel meets its torch reference in the default suite
(test_kernels*.py, test_quant_kernels.py, test_lora_kernels.py); this runs them all through the engine."""

import pytest

from gpushare import SamplingParams
from test_engine import chat_ids, run_all, small_engine


@pytest.mark.slow
def test_triton_path_gives_the_same_greedy_tokens(llm, monkeypatch):
    prompts = [chat_ids(llm, "Hi!"), chat_ids(llm, "Name a bird.")]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    torch_engine = small_engine(llm, num_blocks=16)
    try:
        expected = [r[0] for r in run_all(torch_engine, prompts, params)]
    finally:
        torch_engine.shutdown()
    monkeypatch.setenv("GPUSHARE_KERNELS", "triton")
    triton_engine = small_engine(llm, num_blocks=16)
    try:
        got = [r[0] for r in run_all(triton_engine, prompts, params)]
    finally:
        triton_engine.shutdown()
    assert got == expected
