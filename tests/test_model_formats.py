"""Safetensors folders and bfloat16 load and answer like the GGUF in float32."""

import threading

import torch

from gpushare import LLM, SamplingParams
from gpushare.engine.engine import Engine, EngineConfig
from gpushare.engine.sequence import Sequence
from gpushare.models.loader import load_model
from model_files import gguf_to_hf_folder, random_llama_folder

SMOLLM2_PARAMETERS = 134_515_008  # SmolLM2-135M, tied embeddings counted once
CONVS = [[{"role": "user", "content": "Tell me about the history of Paris."}],
         [{"role": "user", "content": "Why is the sky blue?"}]]


def greedy(n=12):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_sharded_safetensors_folder_answers_like_the_gguf(llm, smollm2_path, tmp_path):
    folder = gguf_to_hf_folder(smollm2_path, str(tmp_path / "smollm2-hf"))
    hf_llm = LLM(folder, dtype="float32", weights="float32", kv_dtype="float32", num_threads=2)  # the exact path, as `llm`
    try:
        assert hf_llm.model.render_chat(CONVS[0]) == llm.model.render_chat(CONVS[0])
        got = [o.token_ids for o in hf_llm.chat(CONVS, greedy())]
    finally:
        hf_llm.shutdown()
    assert got == [o.token_ids for o in llm.chat(CONVS, greedy())]


def test_random_llama_matches_transformers(smollm2_path, tmp_path):
    from transformers import AutoModelForCausalLM

    folder = random_llama_folder(smollm2_path, str(tmp_path / "tiny"))
    ours = load_model(folder)
    ids = [1, 2, 3, 400, 500, 600, 7000]
    engine = Engine(EngineConfig(kv_dtype="float32", kv_cache_bytes=1 << 20))
    engine.add_model("tiny", ours)
    runner = engine.models["tiny"].runner
    seq = Sequence("x", "tiny", ids, greedy(), lambda out: None)
    assert engine.models["tiny"].scheduler.pool.grow(seq.block_table, len(ids)) is None
    hidden, last = runner.hidden_states([seq], [len(ids)])
    got = ours.model.logits(hidden)
    expected = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(torch.tensor([ids])).logits[0]
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-3)


def test_bfloat16_runs_on_cpu_and_agrees_on_the_first_token(llm, smollm2_path):
    bf16 = load_model(smollm2_path, dtype="bfloat16", weights="bfloat16")
    assert bf16.model.embed_tokens.weight.dtype == torch.bfloat16
    assert bf16.weight_bytes == 2 * SMOLLM2_PARAMETERS  # bf16 weights stay dense: 2 bytes each
    engine = Engine(EngineConfig(kv_cache_bytes=16 << 20))
    engine.add_model("bf16", bf16)
    engine.start()
    try:
        ids = llm.tokenizer.encode(llm.model.render_chat(CONVS[1]))
        done, tokens = threading.Event(), []

        def on_output(out):
            tokens.extend(out.token_ids)
            if out.finished:
                done.set()

        engine.submit(engine.request("bf16", ids, greedy(8)), on_output)
        assert done.wait(120)
    finally:
        engine.shutdown()
    reference = llm.generate([ids], greedy(8))[0].token_ids
    # bf16 rounding may change later near-ties; the first answer token must survive it.
    assert len(tokens) == 8 and tokens[0] == reference[0]


def test_a_dense_folder_served_quantized_lets_go_of_its_file(smollm2_path, tmp_path):
    """Served as int8, a float32 folder's tensors are copies: a view into safetensors' mapping would
    keep the whole file mapped, every page read resident beside the quantized copy, for the model's life."""
    folder = random_llama_folder(smollm2_path, str(tmp_path / "tiny"))
    loaded = load_model(folder, weights="int8")
    with open("/proc/self/maps") as maps:
        mapped = [line.split()[-1] for line in maps if line.rstrip().endswith(".safetensors")]
    assert loaded.model is not None and not [path for path in mapped if path.startswith(folder)]
