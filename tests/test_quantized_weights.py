"""Quantized weights (engine.weights): exact conversion of GGUF 4-bit blocks, sizes, answers that do
not depend on batch neighbours, safetensors folders quantized as they load, and config errors."""

import logging

import numpy as np
import pytest
import torch

from gpushare import LLM, SamplingParams
from gpushare.settings.settings import ConfigError, parse_settings
from gpushare.models.cpu_kernels import forget_verdicts, wide_int8_kernel
from gpushare.catalog.gguf_reader import read_gguf_file
from gpushare.models.loader import load_model
from gpushare.models.quantized import Int8Weight, int4_from_gguf, quantize, quantize_int4, quantize_int8
from kernel_choice import use_cpu_kernel
from model_files import gguf_to_hf_folder

SMOLLM2_FLOAT32_BYTES = 134_515_008 * 4  # its parameters as float32, tied embedding once
PROMPTS = ["Why is the sky blue?", "Name three fruits.", "What is 2 + 2?", "Tell me about Paris.",
           "Write a short poem.", "Who wrote Hamlet?", "How do magnets work?", "Describe a cat.",
           "What is Python?", "Give me a recipe.", "Explain rain.", "What is the moon?",
           "Count to five.", "Say hello in French.", "What is gravity?", "Define a noun."]


def greedy(n=24):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_q4_blocks_convert_to_int4_bit_for_bit(smollm2_path):
    from gguf import quants

    _, tensors = read_gguf_file(smollm2_path)
    checked = 0
    for t in tensors:
        if t.tensor_type.name == "Q4_1" and t.name.startswith("blk.0."):
            shape = [int(d) for d in reversed(t.shape)]
            w = int4_from_gguf(t.data, "Q4_1", shape)
            expected = torch.from_numpy(quants.dequantize(t.data, t.tensor_type).reshape(shape))
            assert torch.equal(w.dequantize(), expected), t.name
            checked += 1
    assert checked == 7  # q, k, v, o, gate, up, down


def test_q4_0_blocks_convert_to_int4_bit_for_bit():
    from gguf import GGMLQuantizationType, quants

    dense = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    blocks = quants.quantize(dense, GGMLQuantizationType.Q4_0)
    expected = torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType.Q4_0))
    assert torch.equal(int4_from_gguf(blocks, "Q4_0", [8, 64]).dequantize(), expected)


def test_quantizers_stay_within_half_a_step():
    w = torch.randn(64, 256)
    q8 = quantize_int8(w)
    assert (q8.dequantize() - w).abs().amax(dim=1).le(q8.scales / 2 + 1e-6).all()
    q4 = quantize_int4(w)
    step = q4.scales.repeat_interleave(q4.group_size, dim=1)
    assert (q4.dequantize() - w).abs().le(step / 2 + 1e-6).all()


def test_int4_falls_back_to_int8_with_a_logged_reason(caplog):
    with caplog.at_level(logging.WARNING, logger="gpushare.models"):
        w = quantize("odd.weight", torch.randn(8, 40), "int4")
    assert isinstance(w, Int8Weight)
    assert "not a multiple of 32" in caplog.text and "odd.weight" in caplog.text


def test_the_4_bit_test_leaves_the_embedding_and_output_out(smollm2_path):
    """The bundled file's layers are Q4_1 and its embedding Q8_0: a 4-bit file (both end up int8)."""
    from gpushare.catalog.gguf_reader import open_gguf
    from gpushare.catalog.model_head import matrix_types

    _, tensors = open_gguf(smollm2_path)
    assert {t.tensor_type.name for t in tensors if t.name == "token_embd.weight"} == {"Q8_0"}
    assert matrix_types(tensors) == {"Q4_1"}


def test_quantized_models_are_a_fraction_of_float32(smollm2_path):
    int8 = load_model(smollm2_path, weights="int8")
    int4 = load_model(smollm2_path, weights="int4")
    assert int8.weights == "int8" and int4.weights == "int4"
    assert int8.weight_bytes <= 0.35 * SMOLLM2_FLOAT32_BYTES
    assert int4.weight_bytes <= 0.2 * SMOLLM2_FLOAT32_BYTES
    layer = int4.model.layers[0]
    assert layer.mlp.down_proj.format == "int4" and int4.model.lm_head.format.startswith("int8")


@pytest.fixture(params=["blocks", "torch"])
def cpu_kernel(request, monkeypatch):
    use_cpu_kernel(request.param, monkeypatch, request)
    return request.param


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantized_linears_compute_each_row_alone(weights, cpu_kernel):
    """A row's result is bit for bit the same alone and among neighbours: nothing is scaled per batch."""
    from gpushare.models.linear import Linear

    for out_features, in_features in [(960, 576), (3072, 576), (576, 1536)]:
        linear = Linear(in_features, out_features, bias=False)
        weight = torch.randn(out_features, in_features) / 50
        quantized = quantize(f"{weights}.weight", weight, weights)
        linear.set_quantized(quantized, "cpu")
        assert linear.blocks == (cpu_kernel == "blocks")
        x = torch.randn(40, in_features)
        together = linear(x)
        for rows in (1, 7, 16):
            assert torch.equal(linear(x[:rows]), together[:rows])
        reference = x @ quantized.dequantize().T
        assert ((together - reference).abs().max() / reference.abs().max()).item() < 2e-2


@pytest.fixture
def wide_int8(monkeypatch, request):
    """int8 linears on torch's kernel compute wide prefill chunks on dequantized bfloat16 weights, whatever
    this CPU's verdicts."""
    use_cpu_kernel("torch", monkeypatch, request)
    monkeypatch.setenv("GPUSHARE_CPU_WIDE_INT8", "bfloat16")
    forget_verdicts()
    yield
    forget_verdicts()


@pytest.mark.usefixtures("wide_int8")
def test_wide_int8_rows_do_not_depend_on_their_neighbours(monkeypatch):
    """Rows of wide prefill chunks: the same bits whatever rows come with them, tiled or not, close to the
    float32 product; the rows after them exactly the decode kernel's."""
    from gpushare.models import int8_wide
    from gpushare.models import linear as linear_module

    gen = torch.Generator().manual_seed(1)
    linear = linear_module.Linear(576, 3072, bias=False)
    weight = torch.randn(3072, 576, generator=gen) / 50
    linear.set_quantized(quantize("int8.weight", weight, "int8"), "cpu")
    x = torch.randn(300, 576, generator=gen)
    together = linear(x, wide_rows=200)
    assert torch.equal(linear(x[:80], wide_rows=80), together[:80])
    assert torch.equal(linear(x[:200], wide_rows=200), together[:200])
    assert torch.equal(linear(x[200:]), together[200:])  # the decode kernel's rows, as alone
    reference = x[:200] @ linear.qweight.float().mul(linear.scales[:, None]).T
    assert ((together[:200] - reference).abs().max() / reference.abs().max()).item() < 2e-2
    monkeypatch.setattr(int8_wide, "WIDE_TILE_ELEMENTS", 576 * 1000)  # three tiles and a short one
    torch.testing.assert_close(linear(x, wide_rows=200), together, rtol=0, atol=1e-6)


# The torch path's wide chunks run torch's bfloat16 matmuls, slow on a CPU without AVX-512 BF16: ~50 s on
# an AVX2-only Zen 3 (the default suite's largest test there), ~10 s for the block kernel, the default.
@pytest.mark.parametrize("path", ["blocks", pytest.param("torch wide", marks=pytest.mark.slow)])
def test_long_prompts_answer_the_same_alone_and_among_neighbours(smollm2_path, path, request, monkeypatch):
    if path == "blocks":
        use_cpu_kernel("blocks", monkeypatch, request)
    else:
        request.getfixturevalue("wide_int8")
    long_prompt = "Summarise this: " + " ".join(PROMPTS * 3)  # ~120 tokens: a wide chunk
    llm = LLM(smollm2_path, weights="int8", num_threads=2, enable_prefix_caching=False)
    try:
        alone = llm.chat([[{"role": "user", "content": long_prompt}]], greedy(24))[0].token_ids
        convs = [[{"role": "user", "content": long_prompt}]] + [
            [{"role": "user", "content": p if i % 2 else p + " " + long_prompt}] for i, p in enumerate(PROMPTS[1:])]
        batched = llm.chat(convs, greedy(24))
    finally:
        llm.shutdown()
    assert batched[0].token_ids == alone


# float32 slow (~15 s of dense matmuls): the exact path, which the oracle tests check in the default suite
@pytest.mark.parametrize("weights", ["auto", "int4", pytest.param("float32", marks=pytest.mark.slow)])
def test_answers_do_not_depend_on_batch_neighbours(smollm2_path, weights):
    # Without the prefix cache: the batch would reuse the alone runs' prompt blocks and compute only
    # the rest of each prompt, a question of chunking rather than of neighbours.
    llm = LLM(smollm2_path, weights=weights, num_threads=2, enable_prefix_caching=False)
    try:
        convs = [[{"role": "user", "content": p}] for p in PROMPTS]
        alone = [llm.chat([conv], greedy(40))[0].token_ids for conv in convs[:3]]
        batched = llm.chat(convs, greedy(40))
    finally:
        llm.shutdown()
    assert [o.token_ids for o in batched[:3]] == alone
    assert len({tuple(o.token_ids) for o in batched}) > 8  # really different sequences around them


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantized_stays_close_to_float32(llm, smollm2_path, weights):
    """Per position of a text, the quantized model's next-token choice is float32's almost everywhere."""
    from gpushare.engine.engine import Engine, EngineConfig
    from gpushare.engine.sequence import Sequence

    text = " ".join(PROMPTS) + " The quick brown fox jumps over the lazy dog while the sun sets slowly."
    ids = llm.tokenizer.encode(text, add_special_tokens=True)
    argmax = {}
    for name, loaded in (("float32", llm.model), (weights, load_model(smollm2_path, weights=weights))):
        engine = Engine(EngineConfig(kv_dtype="float32", kv_cache_bytes=8 << 20))
        engine.add_model(name, loaded)
        seq = Sequence("x", name, ids, greedy(), lambda out: None)
        assert engine.models[name].scheduler.pool.grow(seq.block_table, len(ids)) is None
        hidden, _ = engine.models[name].runner.hidden_states([seq], [len(ids)])
        argmax[name] = loaded.model.logits(hidden).argmax(dim=-1)
    agreement = (argmax[weights] == argmax["float32"]).float().mean().item()
    assert agreement >= 0.9, agreement


def test_safetensors_folder_quantizes_as_it_loads_like_the_gguf(smollm2_path, tmp_path):
    folder = gguf_to_hf_folder(smollm2_path, str(tmp_path / "smollm2-hf"))
    convs = [[{"role": "user", "content": p}] for p in PROMPTS[:3]]
    answers = []
    for path in (folder, smollm2_path):
        # Without the prefix cache: whether a prompt reuses the shared system prompt's blocks depends
        # on when its neighbour's prefill committed them, and reusing changes rounding (a near tie here).
        llm = LLM(path, weights="int8", num_threads=2, enable_prefix_caching=False)
        try:
            assert isinstance(llm.model.model.layers[0].mlp.gate_up_proj.scales, torch.Tensor)
            answers.append([o.token_ids for o in llm.chat(convs, greedy(12))])
        finally:
            llm.shutdown()
    assert answers[0] == answers[1]


@pytest.mark.parametrize("section", ["engine", "models"])
def test_unknown_weights_value_is_a_config_error_naming_the_key(section, smollm2_path):
    raw = {"engine": {"weights": "int3"}} if section == "engine" else \
        {"models": [{"name": "m", "path": smollm2_path, "weights": "int3"}]}
    key = r"engine\.weights" if section == "engine" else r"models\[0\]\.weights"
    with pytest.raises(ConfigError, match=rf"{key}: must be one of auto, int8, int4, bfloat16, float16, float32"):
        parse_settings(raw, env={})


@pytest.mark.parametrize("target", ["int8", "int4"])
def test_blocks_quantize_a_few_thousand_rows_at_a_time_with_the_same_result(smollm2_path, target, monkeypatch):
    """The Q8_0 embedding (49,152 rows) goes to int8 or int4 in slices of rows, equal to converting it whole."""
    from gpushare.models import gguf_file
    from gpushare.catalog.gguf_reader import open_gguf

    _, tensors = open_gguf(smollm2_path)
    embedding = next(t for t in tensors if t.name == "token_embd.weight")
    shape = [int(d) for d in reversed(embedding.shape)]
    whole = quantize("w", gguf_file._dense(embedding.data, "Q8_0", shape), target)
    monkeypatch.setattr(gguf_file, "QUANTIZE_ROWS", 5000)  # ten slices, the last one short
    monkeypatch.setattr("gpushare.protocol.weight_format.target_of", lambda name, weights: target)
    sliced = gguf_file._convert(embedding, "w", shape, target)
    assert type(sliced) is type(whole) and torch.equal(sliced.qweight, whole.qweight)
    assert torch.equal(sliced.scales, whole.scales)
    assert target == "int8" or torch.equal(sliced.mins, whole.mins)


def test_the_wide_rows_verdict_measures_torchs_kernel_whatever_this_machine_runs(tmp_path, monkeypatch, request):
    """wide_int8_kernel times torch's int8 paths, which its Linear must hold even where the block kernel
    is this machine's choice (it packs weights otherwise, and has no plain int8 rows to time)."""
    from gpushare.models import cpu_kernels
    from gpushare.node.cpu_verdicts import read_verdict

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("GPUSHARE_CPU_WIDE_INT8", raising=False)
    monkeypatch.setattr(cpu_kernels, "other_processes_cores", lambda: 0.0)  # measure even on a busy machine
    monkeypatch.setattr(cpu_kernels, "layer_stack", lambda total_bytes: cpu_kernels.LAYER_SHAPES)  # one layer
    use_cpu_kernel("blocks", monkeypatch, request)
    totals, _ = cpu_kernels._measure_wide()
    assert set(totals) == {"bfloat16", "int8pack"} and min(totals.values()) > 0
    monkeypatch.setattr(cpu_kernels, "_measure_wide", lambda: (totals, 0.0))
    assert wide_int8_kernel() == cpu_kernels.choose(totals, "bfloat16")
    assert read_verdict("wide-int8").choice == wide_int8_kernel()
