"""Random-weight models for benchmarks/gpu_check.py, written as Hugging Face folders at run time: a
lent GPU machine has no network and room for a few tens of MiB brought along, so no GGUF travels.

Each has a real model's layer shapes from its config.json (SmolLM2-135M whole; Llama-3-8B and
Gemma-2-9B with two of their 32 / 42 layers, Gemma's one sliding and one global), SmolLM2's
vocabulary (49,152, so that its tokenizer, checked in as benchmarks/data/smollm2_tokenizer.json.gz,
names every id: the big models' embedding and output matrices are smaller than theirs) and weights
drawn from N(0, 0.02). Speeds of the two-layer models are those of two layers plus the head.

    python benchmarks/gpu_check_models.py --tokenizer-from SmolLM2-135M-Instruct.Q4_1.gguf

writes the tokenizer files again from a GGUF (what was done to make them).
"""

import argparse
import gzip
import json
import os
from pathlib import Path

import torch

DATA = Path(__file__).resolve().parent / "data"
TOKENIZER_GZ = DATA / "smollm2_tokenizer.json.gz"
TOKENIZER_CONFIG = DATA / "smollm2_tokenizer_config.json"
VOCAB = 49152
STD = 0.02

_LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], rms_norm_eps=1e-5, vocab_size=VOCAB)
CONFIGS = {
    # HuggingFaceTB/SmolLM2-135M-Instruct's config.json
    "smollm2-135m": dict(_LLAMA, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=True),
    # meta-llama/Meta-Llama-3-8B-Instruct's, 2 of 32 layers, vocabulary 128,256 -> SmolLM2's
    "llama-3-8b-2layers": dict(_LLAMA, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                               max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False),
    # google/gemma-2-9b-it's, 2 of 42 layers (one sliding, one global), vocabulary 256,000 -> SmolLM2's
    "gemma-2-9b-2layers": dict(model_type="gemma2", architectures=["Gemma2ForCausalLM"], vocab_size=VOCAB,
                               hidden_size=3584, intermediate_size=14336, num_hidden_layers=2,
                               num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                               max_position_embeddings=8192, rope_theta=10000.0, rms_norm_eps=1e-6,
                               hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256,
                               attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=4096,
                               tie_word_embeddings=True),
}
# the CPU dry run: the same architectures and code, tiny
DRY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16)


def config_for(name: str, dry: bool) -> dict:
    config = dict(CONFIGS[name])
    if dry:
        config.update({k: v for k, v in DRY_SHAPE.items() if k in config})
    return config


def state_dict(config: dict, device: str) -> dict:
    """Random bf16 weights with the folder's tensor names, drawn on ``device`` (seconds on a GPU for 1.7 GB)."""
    gen = torch.Generator(device=device).manual_seed(0)
    hidden, inter, head_dim = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q_out, kv_out = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    gemma = config["model_type"] == "gemma2"

    def w(*shape):
        return (torch.randn(*shape, generator=gen, device=device) * STD).to(torch.bfloat16).cpu()

    def norm():  # Gemma multiplies by 1 + w
        return (torch.zeros if gemma else torch.ones)(hidden, dtype=torch.bfloat16)

    norms = (["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"]
             if gemma else ["input_layernorm", "post_attention_layernorm"])
    state = {"model.embed_tokens.weight": w(config["vocab_size"], hidden), "model.norm.weight": norm()}
    if not config["tie_word_embeddings"]:
        state["lm_head.weight"] = w(config["vocab_size"], hidden)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        state.update({f"{p}.{n}.weight": norm() for n in norms})
        state.update({
            f"{p}.self_attn.q_proj.weight": w(q_out, hidden), f"{p}.self_attn.k_proj.weight": w(kv_out, hidden),
            f"{p}.self_attn.v_proj.weight": w(kv_out, hidden), f"{p}.self_attn.o_proj.weight": w(hidden, q_out),
            f"{p}.mlp.gate_proj.weight": w(inter, hidden), f"{p}.mlp.up_proj.weight": w(inter, hidden),
            f"{p}.mlp.down_proj.weight": w(hidden, inter),
        })
    return state


def write_tokenizer(folder: str) -> int:
    """SmolLM2's tokenizer.json and tokenizer_config.json into ``folder``; returns its end-of-text id."""
    with gzip.open(TOKENIZER_GZ, "rb") as f:
        spec = f.read()
    with open(os.path.join(folder, "tokenizer.json"), "wb") as f:
        f.write(spec)
    tok_config = json.loads(TOKENIZER_CONFIG.read_text())
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(tok_config, f)
    vocab = json.loads(spec)["added_tokens"]
    return next(t["id"] for t in vocab if t["content"] == tok_config["eos_token"])


def write_model(name: str, folder: str, dry: bool, device: str) -> str:
    """``folder`` holding the random model ``name`` (config.json, model.safetensors, the tokenizer)."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    config = config_for(name, dry)
    config["eos_token_id"] = write_tokenizer(folder)
    save_file(state_dict(config, device), os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return folder


def write_adapter(name: str, folder: str, dry: bool, seed: int, rank: int = 16) -> str:
    """A random PEFT LoRA folder for the model ``name``: every attention and MLP matrix, ``rank``,
    alpha 2 * rank, B drawn as A is (PEFT starts B at zero: an adapter that did nothing would hide a
    kernel that dropped it)."""
    from safetensors.torch import save_file

    config = config_for(name, dry)
    hidden, inter, head_dim = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q_out, kv_out = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"self_attn.q_proj": (hidden, q_out), "self_attn.k_proj": (hidden, kv_out),
              "self_attn.v_proj": (hidden, kv_out), "self_attn.o_proj": (q_out, hidden),
              "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter), "mlp.down_proj": (inter, hidden)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(config["num_hidden_layers"]):
        for target, (fan_in, fan_out) in shapes.items():
            key = f"base_model.model.model.layers.{i}.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * fan_in ** -0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * rank ** -0.5 / 4
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "base_model_name_or_path": name,
                   "target_modules": [t.split(".")[1] for t in shapes]}, f)
    return folder


def tokenizer_from_gguf(gguf_path: str) -> None:
    """Write TOKENIZER_GZ and TOKENIZER_CONFIG from a SmolLM2 GGUF (reproducible bytes: no gzip time stamp)."""
    from gpushare.catalog.gguf_reader import read_gguf_file
    from gpushare.catalog.tokenizer import tokenizer_from_gguf as from_meta

    meta, _ = read_gguf_file(gguf_path)
    tokenizer = from_meta(meta)
    with gzip.GzipFile(TOKENIZER_GZ, "wb", compresslevel=9, mtime=0) as f:
        f.write(tokenizer.hf.to_str().encode())
    TOKENIZER_CONFIG.write_text(json.dumps({"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
                                            "chat_template": meta.get("tokenizer.chat_template")}, indent=1) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer-from", required=True, help="a SmolLM2 GGUF to take the tokenizer from")
    tokenizer_from_gguf(parser.parse_args().tokenizer_from)
