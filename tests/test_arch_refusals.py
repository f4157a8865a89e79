"""Models we cannot run exactly are refused at load, naming what they ask for and what we support."""

import json
import shutil

import pytest

from arch_models import hf_to_gguf, save_hf_model
from gpushare.catalog.model_config import config_from_gguf, config_from_hf
from gpushare.models.loader import load_model

LLAMA = {"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}


@pytest.mark.parametrize("extra, named", [
    ({"model_type": "falcon"}, "'falcon'"),
    ({"model_type": "gemma3"}, "text_config"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn'"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "'dynamic'"),
    ({"hidden_act": "relu"}, "'relu'"),
    ({"partial_rotary_factor": 0.75}, "partial_rotary_factor"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"layer_types": ["full_attention", "chunked_attention"]}, "chunked_attention"),
    ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, "use_bidirectional_attention"),
])
def test_unsupported_hf_configs_are_refused_by_name(extra, named):
    with pytest.raises(ValueError, match="supported") as error:
        config_from_hf({**LLAMA, **extra})
    assert named in str(error.value)


def gguf_meta(arch="llama", **extra):
    base = {"general.architecture": arch, f"{arch}.attention.head_count": 4, f"{arch}.embedding_length": 64,
            f"{arch}.block_count": 2, f"{arch}.feed_forward_length": 128, f"{arch}.context_length": 256,
            "tokenizer.ggml.tokens": ["a", "b"]}
    return {**base, **{f"{arch}.{k}": v for k, v in extra.items()}}


@pytest.mark.parametrize("meta, named", [
    (gguf_meta("falcon"), "'falcon'"),
    (gguf_meta(**{"rope.scaling.type": "yarn"}), "'yarn'"),
    (gguf_meta(**{"attention.key_length": 16, "rope.dimension_count": 8}), "partial rotary"),
    (gguf_meta(**{"attention.value_length": 32}), "value_length"),
    (gguf_meta(**{"expert_count": 8}), "expert_count"),
])
def test_unsupported_gguf_metadata_is_refused_by_name(meta, named):
    with pytest.raises(ValueError) as error:
        config_from_gguf(meta)
    assert named in str(error.value)


def test_windows_and_softcaps_in_gguf_metadata_are_honoured():
    config = config_from_gguf(gguf_meta("gemma2", **{"attention.sliding_window": 16, "attn_logit_softcapping": 50.0,
                                                      "final_logit_softcapping": 30.0}))
    assert config.layer_windows == [16, 0]  # Gemma 2: sliding, then global
    assert (config.attn_softcap, config.final_softcap) == (50.0, 30.0)
    mistral = config_from_gguf(gguf_meta(**{"attention.sliding_window": 16}))
    assert mistral.layer_windows == [16, 16] and mistral.kv_window == 16


def test_a_folder_asking_for_an_unsupported_rope_type_is_not_loaded(tmp_path, smollm2_path):
    folder = save_hf_model("mistral", str(tmp_path / "hf"), smollm2_path)
    config_file = tmp_path / "hf" / "config.json"
    raw = json.loads(config_file.read_text())
    raw["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                              "original_max_position_embeddings": 128}
    config_file.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="unsupported rope scaling 'yarn'.*longrope"):
        load_model(folder, weights="float32")


def test_a_gguf_whose_metadata_disagrees_with_its_tensors_is_refused_naming_the_tensor(tmp_path, smollm2_path):
    folder = save_hf_model("qwen3", str(tmp_path / "hf"), smollm2_path)
    lying = tmp_path / "lying"
    shutil.copytree(folder, lying)
    raw = json.loads((lying / "config.json").read_text())
    raw["intermediate_size"] = 96  # the tensors hold 128
    (lying / "config.json").write_text(json.dumps(raw))
    path = hf_to_gguf(str(lying), str(tmp_path / "lying.gguf"), smollm2_path)
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.down_proj\.weight has shape \[64, 128\].*needs \[64, 96\]"):
        load_model(path, weights="float32")


def test_phi3_gguf_uses_longrope_only_past_its_original_context():
    short = config_from_gguf(gguf_meta("phi3", **{"rope.scaling.original_context_length": 256}))
    assert short.rope_scaling == {}  # Phi-3-mini-4k: the original context is the context
    long = config_from_gguf(gguf_meta("phi3", **{"rope.scaling.original_context_length": 64,
                                                 "rope.scaling.attn_factor": 1.2}))
    assert long.rope_scaling["rope_type"] == "longrope" and long.rope_scaling["attention_factor"] == 1.2
