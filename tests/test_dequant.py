"""GGUF block formats: our torch dequantisation bit for bit against gguf.quants, Q4_K straight into
int4, and a Q4_K_M model file (Q4_K and Q6_K) answering exactly as its dequantised float32 copy."""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from arch_models import hf_to_gguf, save_hf_model
from gpushare import LLM, SamplingParams
from gpushare.models.dequant import FAST, FP16_OFFSETS, dequantize
from gpushare.catalog.gguf_reader import read_gguf_file
from gpushare.models.loader import read_gguf
from gpushare.models.quantized import Int4Weight, int4_from_gguf
from kquants import quantize_q4_k, quantize_q6_k

def random_blocks(type_name: str, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """Random bytes in every field, finite random scales: ``[rows, bytes per row]`` uint8."""
    qtype = GGMLQuantizationType[type_name]
    _, block_bytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * blocks_per_row, block_bytes), dtype=np.uint8)
    for offset in FP16_OFFSETS[type_name]:
        scales = (rng.standard_normal(len(blocks)) * 0.01).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("type_name", sorted(FAST))
def test_dequantisation_is_bit_exact_against_gguf(type_name):
    assert set(FP16_OFFSETS) == set(FAST)
    qtype = GGMLQuantizationType[type_name]
    block_weights, _ = GGML_QUANT_SIZES[qtype]
    raw = random_blocks(type_name, rows=6, blocks_per_row=3, seed=len(type_name))
    shape = [6, 3 * block_weights]
    ours = dequantize(raw, type_name, shape)
    expected = torch.from_numpy(quants.dequantize(raw, qtype).reshape(shape))
    assert ours.dtype == torch.float32 and ours.abs().max() > 0
    assert torch.equal(ours, expected)


def test_q4_k_blocks_convert_to_int4_bit_for_bit():
    raw = random_blocks("Q4_K", rows=5, blocks_per_row=2, seed=1)
    weight = int4_from_gguf(raw, "Q4_K", [5, 512])
    assert isinstance(weight, Int4Weight) and weight.group_size == 32
    expected = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q4_K))
    assert torch.equal(weight.dequantize(), expected)


@pytest.mark.parametrize("encode, type_name", [(quantize_q4_k, "Q4_K"), (quantize_q6_k, "Q6_K")])
def test_test_encoders_write_blocks_that_decode_near_their_input(encode, type_name):
    w = np.random.default_rng(0).standard_normal((4, 512)).astype(np.float32)
    decoded = quants.dequantize(encode(w), GGMLQuantizationType[type_name])
    step = {"Q4_K": 2 * np.abs(w).max() / 15, "Q6_K": np.abs(w).max() / 31}[type_name]
    assert np.abs(decoded - w).max() <= step


def q4_k_m(name: str, array: np.ndarray):
    """llama.cpp's Q4_K_M mix: Q6_K for attn_v, ffn_down and the embedding, Q4_K for the other
    matrices, float32 norms."""
    if array.ndim != 2:
        return None
    if name.endswith(("v_proj.weight", "down_proj.weight", "embed_tokens.weight")):
        return quantize_q6_k(array), GGMLQuantizationType.Q6_K
    return quantize_q4_k(array), GGMLQuantizationType.Q4_K


@pytest.fixture(scope="module")
def q4_k_m_files(tmp_path_factory, smollm2_path):
    """A tiny Llama (hidden 256: whole K-quant super-blocks) as Q4_K_M, and its dequantised float32 copy."""
    root = tmp_path_factory.mktemp("q4km")
    folder = save_hf_model("llama", str(root / "hf"), smollm2_path)
    quantized = hf_to_gguf(folder, str(root / "q4_k_m.gguf"), smollm2_path, quantize=q4_k_m)
    _, tensors = read_gguf_file(quantized)
    decoded = {t.name: quants.dequantize(t.data, t.tensor_type) for t in tensors}
    assert {t.tensor_type.name for t in tensors if len(t.shape) == 2} == {"Q4_K", "Q6_K"}
    reference = write_float32_copy(quantized, decoded, str(root / "reference.gguf"))
    return quantized, reference


def write_float32_copy(path: str, decoded: dict, out: str) -> str:
    """``path`` with every tensor replaced by its decoded float32 values (metadata copied)."""
    import gguf

    meta, tensors = read_gguf_file(path)
    writer = gguf.GGUFWriter(out, meta["general.architecture"])
    for key, value in meta.items():
        if key.startswith("general.") or key.startswith("GGUF."):
            continue
        writer.add_key_value(key, value, _value_type(value))
    for t in tensors:
        writer.add_tensor(t.name, decoded[t.name].astype(np.float32).reshape([int(d) for d in reversed(t.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _value_type(value):
    from gguf import GGUFValueType

    if isinstance(value, list):
        return GGUFValueType.ARRAY
    if isinstance(value, str):
        return GGUFValueType.STRING
    if isinstance(value, float):
        return GGUFValueType.FLOAT32
    return GGUFValueType.UINT32


def test_a_q4_k_m_file_answers_like_its_dequantised_reference(q4_k_m_files):
    quantized, reference = q4_k_m_files
    prompts = [[1, 2, 3, 400, 500, 600, 7000], list(range(1000, 1040))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    answers = {}
    for name, path in (("q4_k_m", quantized), ("reference", reference)):
        llm = LLM(path, weights="float32", kv_cache_bytes=1 << 22, num_threads=1)
        try:
            answers[name] = [o.token_ids for o in llm.generate(prompts, params)]
        finally:
            llm.shutdown()
    assert answers["q4_k_m"] == answers["reference"]


def test_a_q4_k_m_file_reads_as_its_reference_exactly_and_q4_k_straight_into_int4(q4_k_m_files):
    quantized, reference = q4_k_m_files
    dense, expected = read_gguf(quantized)[1], read_gguf(reference)[1]
    assert dense.keys() == expected.keys()
    assert all(torch.equal(dense[name], expected[name]) for name in expected)
    as_int4 = read_gguf(quantized, weights="int4")[1]
    q_proj = as_int4["model.layers.0.self_attn.q_proj.weight"]  # Q4_K: no rounding on the way to int4
    assert isinstance(q_proj, Int4Weight)
    assert torch.equal(q_proj.dequantize(), expected["model.layers.0.self_attn.q_proj.weight"])
