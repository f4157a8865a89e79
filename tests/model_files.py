"""Model folders the tests write themselves: the GGUF converted to safetensors, and a random Llama."""

import json
import os

import torch
from safetensors.torch import save_file

from gpushare.models.loader import read_gguf


def _hf_config(config, **extra) -> dict:
    return {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
        "max_position_embeddings": config.context_length, "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta, "tie_word_embeddings": config.tie_word_embeddings, **extra,
    }


def _write_tokenizer(folder, tokenizer, template, eos_id):
    tokenizer.hf.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token, "chat_template": template}, f)


def gguf_to_hf_folder(gguf_path: str, folder: str, shards: int = 2) -> str:
    """Write the GGUF's weights as a sharded Hugging Face safetensors folder."""
    os.makedirs(folder, exist_ok=True)
    config, state, tokenizer, template, stop, _ = read_gguf(gguf_path)
    names = sorted(state)
    for i in range(shards):
        part = {n: state[n].contiguous() for n in names[i::shards]}
        save_file(part, os.path.join(folder, f"model-{i + 1:05d}-of-{shards:05d}.safetensors"))
    eos_id = tokenizer.token_to_id(tokenizer.eos_token)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(_hf_config(config, eos_token_id=eos_id), f)
    _write_tokenizer(folder, tokenizer, template, eos_id)
    return folder


def random_llama_folder(gguf_path: str, folder: str, seed: int = 0, hidden: int = 64, inter: int = 128,
                        layers: int = 2, heads: int = 4, kv_heads: int = 2) -> str:
    """A random-weight Llama (tiny by default: 2 layers, hidden 64) that shares SmolLM2's tokenizer."""
    os.makedirs(folder, exist_ok=True)
    config, _, tokenizer, template, _, _ = read_gguf(gguf_path)
    gen = torch.Generator().manual_seed(seed)
    vocab = config.vocab_size
    head_dim = hidden // heads

    def w(*shape):
        return torch.randn(*shape, generator=gen) * 0.05

    state = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": torch.ones(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}"
        state.update({
            f"{p}.input_layernorm.weight": torch.ones(hidden), f"{p}.post_attention_layernorm.weight": torch.ones(hidden),
            f"{p}.self_attn.q_proj.weight": w(heads * head_dim, hidden),
            f"{p}.self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
            f"{p}.self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
            f"{p}.self_attn.o_proj.weight": w(hidden, heads * head_dim),
            f"{p}.mlp.gate_proj.weight": w(inter, hidden), f"{p}.mlp.up_proj.weight": w(inter, hidden),
            f"{p}.mlp.down_proj.weight": w(hidden, inter),
        })
    save_file(state, os.path.join(folder, "model.safetensors"))
    eos_id = tokenizer.token_to_id(tokenizer.eos_token)
    cfg = {"model_type": "llama", "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter,
           "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
           "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "tie_word_embeddings": True, "eos_token_id": eos_id}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    _write_tokenizer(folder, tokenizer, template, eos_id)
    return folder
