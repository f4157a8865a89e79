"""Tiny random models of each supported architecture, built with transformers from a real config's
shape (few layers, hidden 64), saved as safetensors and converted to GGUF here the way llama.cpp's
converter writes them (names, Q/K permutation, Gemma's norms + 1, Phi-3's fused tensors and LongRoPE
factors). They share SmolLM2's tokenizer: the tests feed token ids.
"""

import json
import os

import numpy as np
import torch

from gpushare.catalog.gguf_reader import read_gguf_file

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 64, 128, 4, 2, 16
WINDOW = 8  # sliding windows: prompts and answers run well past it


def _configs(vocab: int) -> dict:
    from transformers import (Gemma2Config, Gemma3TextConfig, GemmaConfig, LlamaConfig, MistralConfig, Phi3Config,
                              Qwen3Config)

    common = dict(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=INTER, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=512)
    half = HEAD_DIM // 2
    return {
        # Llama 3.x: its rope scaling past an original context of 64 positions; whole K-quant
        # super-blocks (256) in every matrix row, for quantized files.
        "llama": lambda: LlamaConfig(**{**common, "hidden_size": 256, "intermediate_size": 512, "head_dim": 64},
                                     num_hidden_layers=2, tie_word_embeddings=True, rope_parameters={
                                         "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                                         "rope_theta": 500000.0}),
        # Qwen3: q/k norms; heads * head_dim (128) is not the hidden size, as in the real models.
        "qwen3": lambda: Qwen3Config(**{**common, "head_dim": 32}, num_hidden_layers=2, tie_word_embeddings=True,
                                     rope_theta=1e6),
        "gemma": lambda: GemmaConfig(**common, num_hidden_layers=2),
        "mistral": lambda: MistralConfig(**common, num_hidden_layers=2, sliding_window=WINDOW),
        # Gemma 2: sliding and global layers alternating, both soft-caps small enough to bite.
        "gemma2": lambda: Gemma2Config(**common, num_hidden_layers=3, sliding_window=WINDOW,
                                       query_pre_attn_scalar=HEAD_DIM, attn_logit_softcapping=2.0,
                                       final_logit_softcapping=3.0),
        # Gemma 3 (4B's shape): five sliding layers, then a global one with linear rope scaling x8.
        "gemma3": lambda: Gemma3TextConfig(**common, num_hidden_layers=6, sliding_window=WINDOW,
                                           query_pre_attn_scalar=HEAD_DIM, rope_parameters={
                                               "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                  "rope_theta": 1e6},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
        # Phi-3 (128k's shape): LongRoPE past an original context of 64 positions.
        "phi3": lambda: Phi3Config(**{k: v for k, v in common.items() if k != "head_dim"}, num_hidden_layers=2,
                                   original_max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                                   eos_token_id=2, rope_scaling={
                                       "rope_type": "longrope", "short_factor": [1.0 + i / 8 for i in range(half)],
                                       "long_factor": [2.0 + i for i in range(half)]}),
    }


ARCHS = ("llama", "qwen3", "mistral", "gemma", "gemma2", "gemma3", "phi3")


def save_hf_model(arch: str, folder: str, tokenizer_gguf: str, seed: int = 0, **config_changes) -> str:
    """A random ``arch`` model in ``folder`` (config.json, model.safetensors, SmolLM2's tokenizer);
    ``config_changes`` set on its config (``tie_word_embeddings=False``)."""
    from transformers import AutoModelForCausalLM

    meta, _ = read_gguf_file(tokenizer_gguf)
    config = _configs(len(meta["tokenizer.ggml.tokens"]))[arch]()
    for name, value in config_changes.items():
        setattr(config, name, value)
    torch.manual_seed(seed)
    model = _perturbed(AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    model.save_pretrained(folder)
    _write_tokenizer(folder, tokenizer_gguf)
    return folder


def rename_added_tokens(folder: str, names: dict[int, str], special: bool) -> None:
    """Turn the folder's added tokens ``names`` (id -> new text) into the tokens a model family needs
    (<think>, gpt-oss's channel markers), in tokenizer.json's vocabulary and its added tokens."""
    path = os.path.join(folder, "tokenizer.json")
    spec = json.load(open(path))
    for token_id, name in names.items():
        added = spec["added_tokens"][token_id]
        spec["model"]["vocab"][name] = spec["model"]["vocab"].pop(added["content"])
        added.update(content=name, special=special)
    json.dump(spec, open(path, "w"))


def update_json(folder: str, name: str, changes: dict) -> None:
    """Set ``changes`` in the folder's JSON file ``name`` (config.json, tokenizer_config.json)."""
    path = os.path.join(folder, name)
    json.dump({**json.load(open(path)), **changes}, open(path, "w"))


def _perturbed(model):
    """Noise on every weight (norms too): weights big enough to give decisive logits, and norms
    that are not all ones, so a norm read wrong shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.1 if "norm" in name else 0.08))
    return model


def save_gemma3_multimodal(folder: str, tokenizer_gguf: str, seed: int = 0) -> str:
    """A random Gemma 3 checkpoint as the 4B-and-up ones ship: text model, vision tower, projector."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    meta, _ = read_gguf_file(tokenizer_gguf)
    text = _configs(len(meta["tokenizer.ggml.tokens"]))["gemma3"]()
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4)
    torch.manual_seed(seed)
    model = _perturbed(Gemma3ForConditionalGeneration(config))
    model.save_pretrained(folder)
    _write_tokenizer(folder, tokenizer_gguf)
    return folder


def _write_tokenizer(folder: str, tokenizer_gguf: str) -> None:
    from gpushare.catalog.tokenizer import tokenizer_from_gguf

    meta, _ = read_gguf_file(tokenizer_gguf)
    tokenizer = tokenizer_from_gguf(meta)
    tokenizer.hf.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
                   "chat_template": meta.get("tokenizer.chat_template")}, f)


_GGUF_ARCH = {"mistral": "llama"}  # llama.cpp converts Mistral as a Llama
_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "post_attention_layernorm": "ffn_norm",
}
_GEMMA_LAYER_NAMES = {**_LAYER_NAMES, "post_attention_layernorm": "post_attention_norm",
                      "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def _gguf_name(name: str, arch: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if name in top:
        return top[name]
    _, _, layer, rest = name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    names = _GEMMA_LAYER_NAMES if arch in ("gemma2", "gemma3") else _LAYER_NAMES
    return f"blk.{layer}.{names[module]}.{suffix}"


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's Q/K row order for the Llama architecture (rotary halves interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_to_gguf(folder: str, path: str, tokenizer_gguf: str, quantize=None, yes_no: tuple[int, int] | None = None) -> str:
    """Convert the model in ``folder`` to a GGUF at ``path``; ``quantize(name, array)`` may return
    ``(block bytes [rows, bytes per row], GGML type)`` for a tensor, else None: stored as float32.
    ``yes_no``: the (yes, no) token ids of an LLM reranker, written as llama.cpp converts Qwen3-Reranker:
    pooling_type 4, labels [yes, no], and ``cls.output`` (the LM head's yes and no rows) for the LM head."""
    import gguf
    from safetensors.torch import load_file

    raw = json.load(open(os.path.join(folder, "config.json")))
    arch = {"gemma3_text": "gemma3"}.get(raw["model_type"], raw["model_type"])
    gguf_arch = _GGUF_ARCH.get(arch, arch)
    state = load_file(os.path.join(folder, "model.safetensors"))
    writer = gguf.GGUFWriter(path, gguf_arch)
    _write_metadata(writer, raw, arch)
    _copy_tokenizer(writer, tokenizer_gguf)
    if arch == "phi3":
        rope = raw.get("rope_parameters") or raw["rope_scaling"]
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    rope = raw.get("rope_parameters") or {}
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_divisors(rope, raw))
    if yes_no:
        writer.add_pooling_type(gguf.PoolingType.RANK)
        writer.add_classifier_output_labels(["yes", "no"])
        head = state.pop("lm_head.weight", None)
        head = state["model.embed_tokens.weight"] if head is None else head
        writer.add_tensor("cls.output.weight", head[list(yes_no)].float().numpy())
    for name, tensor in state.items():
        if gguf_arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = raw["num_attention_heads"] if "q_proj" in name else raw["num_key_value_heads"]
            tensor = _permute(tensor, heads)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            tensor = tensor + 1  # llama.cpp stores Gemma's (1 + w) norms with the 1 added
        array = tensor.float().numpy()
        stored = quantize(name, array) if quantize else None
        if stored is None:
            writer.add_tensor(_gguf_name(name, arch), array)
        else:
            blocks, qtype = stored  # [rows, bytes per row] uint8: the writer takes the shape from it
            writer.add_tensor(_gguf_name(name, arch), blocks, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _llama3_rope_divisors(rope: dict, raw: dict) -> np.ndarray:
    """llama.cpp's form of Llama 3's rope scaling: one divisor per frequency, as a tensor."""
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    divisors = []
    for wavelen in 2 * np.pi / freqs:
        if wavelen < old / high:
            divisors.append(1.0)
        elif wavelen > old / low:
            divisors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def _write_metadata(writer, raw: dict, arch: str) -> None:
    import gguf

    writer.add_block_count(raw["num_hidden_layers"])
    writer.add_context_length(raw["max_position_embeddings"])
    writer.add_embedding_length(raw["hidden_size"])
    writer.add_feed_forward_length(raw["intermediate_size"])
    writer.add_head_count(raw["num_attention_heads"])
    writer.add_head_count_kv(raw["num_key_value_heads"])
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(raw["rms_norm_eps"])
    rope = raw.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if arch == "phi3":
        original = raw["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(original)
        scale = raw["max_position_embeddings"] / original
        writer.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(original))))
    if raw.get("sliding_window"):
        writer.add_sliding_window(raw["sliding_window"])
    if raw.get("attn_logit_softcapping"):
        writer.add_attn_logit_softcapping(raw["attn_logit_softcapping"])
    if raw.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(raw["final_logit_softcapping"])


def _copy_tokenizer(writer, tokenizer_gguf: str) -> None:
    meta, _ = read_gguf_file(tokenizer_gguf)
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta.get("tokenizer.ggml.pre", "default"))
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    writer.add_chat_template(meta["tokenizer.chat_template"])
