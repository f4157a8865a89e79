"""Llama 3 (its rope scaling), Qwen3, Mistral (sliding window), Gemma 2, Gemma 3 and Phi-3 (LongRoPE)
against transformers.

Each is a tiny random model built with transformers (tests/arch_models.py), loaded by us from its
safetensors folder and from its GGUF conversion, in float32: last-position logits within 1e-3 of
transformers', and 32 greedy tokens equal, alone and in a batch, with prompts and answers well past
the sliding windows (8 tokens) and prefill chunked (16 tokens a step) over blocks of 4 tokens.
"""

import json
import os

import pytest
import torch

from arch_models import ARCHS, WINDOW, hf_to_gguf, save_gemma3_multimodal, save_hf_model
from gpushare import LLM, SamplingParams
from gpushare.engine.engine import Engine, EngineConfig
from gpushare.engine.kv_cache import FREED_BLOCK
from gpushare.engine.sequence import Sequence
from gpushare.models.loader import load_model

NEW_TOKENS = 32
PROMPTS = ["Tell me about the history of Paris and the river that runs through it.",
           "Why is the sky blue?",
           "Write a short poem about the sea, the wind, the gulls and the old lighthouse keeper at night."]
BLOCK_SIZE = 4


@pytest.fixture(scope="module", params=ARCHS)
def arch_model(request, tmp_path_factory, smollm2_path):
    """(arch, safetensors folder, GGUF path, prompt token ids, transformers' greedy answers)."""
    from transformers import AutoModelForCausalLM

    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    folder = save_hf_model(arch, str(root / "hf"), smollm2_path)
    gguf_path = hf_to_gguf(folder, str(root / f"{arch}.gguf"), smollm2_path)
    oracle = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    tokenizer = load_model(folder, weights="float32").tokenizer
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    answers = [greedy_transformers(oracle, ids) for ids in prompts]
    return arch, folder, gguf_path, prompts, answers, oracle


def greedy_transformers(model, ids: list[int], steps: int = NEW_TOKENS) -> list[int]:
    """Greedy decoding by whole forward passes: no cache, no early stop at an EOS."""
    tokens = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(ids):]


def greedy(n=NEW_TOKENS):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
def test_last_position_logits_match_transformers(arch_model, source):
    arch, folder, gguf_path, prompts, _, oracle = arch_model
    loaded = load_model(folder if source == "safetensors" else gguf_path, weights="float32")
    engine = Engine(EngineConfig(block_size=BLOCK_SIZE, kv_cache_bytes=1 << 20, weights="float32"))  # float32 KV
    engine.add_model(arch, loaded)
    worker = engine.models[arch]
    ids = prompts[2]
    seq = Sequence("logits", arch, ids, greedy(), lambda out: None)
    assert worker.scheduler.pool.grow(seq.block_table, len(ids)) is None
    hidden, last = worker.runner.hidden_states([seq], [len(ids)])
    ours = loaded.model.logits(hidden[last[0]])
    with torch.no_grad():
        expected = oracle(torch.tensor([ids])).logits[0, -1]
    assert (ours - expected).abs().max() / expected.abs().max() < 1e-3


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
def test_greedy_tokens_match_transformers_alone_and_in_a_batch(arch_model, source):
    arch, folder, gguf_path, prompts, answers, _ = arch_model
    assert max(len(p) for p in prompts) + NEW_TOKENS > 2 * WINDOW
    llm = LLM(folder if source == "safetensors" else gguf_path, weights="float32", block_size=BLOCK_SIZE,
              max_num_batched_tokens=16, kv_cache_bytes=1 << 20, num_threads=1)
    try:
        alone = [llm.generate([ids], greedy())[0].token_ids for ids in prompts]
        together = [out.token_ids for out in llm.generate(prompts, greedy())]
    finally:
        llm.shutdown()
    assert alone == answers
    assert together == answers


def step_by_step(loaded, prompt: list[int], steps: int):
    """Drive one sequence through the scheduler and runner; yields (seq, pool) after every step."""
    engine = Engine(EngineConfig(block_size=BLOCK_SIZE, max_num_batched_tokens=8, kv_cache_bytes=1 << 20))
    engine.add_model("m", loaded)
    worker = engine.models["m"]
    seq = Sequence("s", "m", prompt, greedy(steps), lambda out: None)
    worker.scheduler.add(seq)
    while len(seq.output_ids) < steps:
        batch = worker.scheduler.schedule()
        step = worker.runner.begin(batch)
        worker.runner.advance(step)
        for s, token in worker.runner.complete(step):
            s.output_ids.append(token)
        worker.scheduler.after_step(batch)
        yield seq, worker.scheduler.pool


def folder_and_oracle(arch: str, tmp_path_factory, smollm2_path):
    from transformers import AutoModelForCausalLM

    folder = save_hf_model(arch, str(tmp_path_factory.mktemp(arch) / "hf"), smollm2_path)
    return folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                        attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def mistral(tmp_path_factory, smollm2_path):
    return folder_and_oracle("mistral", tmp_path_factory, smollm2_path)


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory, smollm2_path):
    """Sliding and global layers and both soft-caps: every new path of the attention kernels."""
    return folder_and_oracle("gemma2", tmp_path_factory, smollm2_path)


def test_sliding_window_frees_the_blocks_behind_every_layers_window(mistral):
    folder, oracle = mistral
    loaded = load_model(folder, weights="float32")
    assert loaded.config.kv_window == WINDOW
    prompt = loaded.tokenizer.encode(PROMPTS[0])
    most_held = 0
    for seq, pool in step_by_step(loaded, prompt, NEW_TOKENS):
        held = [b for b in seq.block_table if b != FREED_BLOCK]
        # The next token (at num_computed) sees the WINDOW - 1 before it: blocks wholly before
        # those are back in the pool, everything from them on is still held.
        first_needed = (seq.num_computed - WINDOW + 1) // BLOCK_SIZE
        assert seq.block_table[:first_needed] == [FREED_BLOCK] * first_needed
        assert FREED_BLOCK not in seq.block_table[first_needed:]
        assert pool.num_used == len(held)
        most_held = max(most_held, len(held))
    assert seq.num_tokens > 4 * WINDOW
    assert most_held <= (WINDOW + 8) // BLOCK_SIZE + 1  # a prefill chunk of 8 plus the window, not the context
    assert seq.output_ids == greedy_transformers(oracle, prompt)


def test_global_layers_keep_every_block(gemma2):
    folder, _ = gemma2
    loaded = load_model(folder, weights="float32")
    assert loaded.config.layer_windows == [WINDOW, 0, WINDOW] and loaded.config.kv_window is None
    for seq, pool in step_by_step(loaded, loaded.tokenizer.encode(PROMPTS[0]), 8):
        assert FREED_BLOCK not in seq.block_table
        assert pool.num_used == len(seq.block_table)


def test_triton_kernels_run_windows_and_softcaps_like_transformers(gemma2, monkeypatch):
    folder, oracle = gemma2
    monkeypatch.setenv("GPUSHARE_KERNELS", "triton")
    loaded = load_model(folder, weights="float32")
    prompt = loaded.tokenizer.encode(PROMPTS[0])
    seq = list(step_by_step(loaded, prompt, 4))[-1][0]  # prefill chunks of 8 past the window, then decodes
    assert seq.output_ids == greedy_transformers(oracle, prompt, 4)


def test_a_folder_stops_at_the_eos_ids_of_its_generation_config(tmp_path, smollm2_path):
    folder = save_hf_model("phi3", str(tmp_path / "phi3"), smollm2_path)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, 7, 11]}, f)  # Phi-3 lists <|end|> (32007) here, not in config.json
    assert {7, 11} <= load_model(folder, weights="float32").stop_token_ids


def test_a_multimodal_gemma3_folder_loads_its_text_model(tmp_path, smollm2_path):
    from transformers import Gemma3ForConditionalGeneration

    folder = save_gemma3_multimodal(str(tmp_path / "gemma3-mm"), smollm2_path)
    loaded = load_model(folder, weights="float32")
    assert loaded.config.arch == "gemma3" and loaded.config.layer_windows == [WINDOW] * 5 + [0]
    prompt = loaded.tokenizer.encode(PROMPTS[0])
    oracle = Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    seq = list(step_by_step(loaded, prompt, 8))[-1][0]
    assert seq.output_ids == greedy_transformers(oracle, prompt, 8)
