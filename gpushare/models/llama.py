"""The one transformer every supported architecture runs as (Llama 2/3, Mistral, Qwen2/3, SmolLM2,
Gemma 1/2/3, Phi-3) over a paged KV cache; ``ModelConfig``'s features say what differs.

Tokens of a batch are flattened into one ``[T, hidden]`` matrix: prefill chunks first, then
single-token decodes. ``AttentionBatch`` says which rows belong to which sequence and where
their keys and values live in the paged cache.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from gpushare import kernels
from gpushare.models import fused_decode
from gpushare.catalog.model_config import ModelConfig
from gpushare.models.linear import Embedding, Linear, linear_bytes
from gpushare.models.lora_table import AdapterTable
from gpushare.models.quantized import Int8Weight, stack_rows
from gpushare.models.rope import apply_rope, rope_table


@dataclass
class AttentionBatch:
    slot_mapping: torch.Tensor          # [T] int64: cache slot of every token
    num_prefill_tokens: int             # rows [0, num_prefill_tokens) are prefill chunks
    prefill_block_tables: torch.Tensor  # [P, W] int32
    prefill_cu_seqlens: torch.Tensor    # [P + 1] int32
    prefill_context_lens: torch.Tensor  # [P] int32, chunk included
    decode_block_tables: torch.Tensor   # [D, W] int32
    decode_context_lens: torch.Tensor   # [D] int32, current token included
    wide_rows: int = 0                  # rows [0, wide_rows): wide prefill chunks (Linear.forward)
    lora_slots: torch.Tensor | None = None  # [T] int32: each row's adapter slot (-1: the base); None: no adapter
    _rows: tuple | None = field(default=None, repr=False, compare=False)

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's block table ``[T, W]`` int32 and context length ``[T]`` int32 (its position + 1):
        a prompt chunk's rows as the decode rows they would be one at a time, for kernels that attend
        row by row (kernels.attention_by_row)."""
        if self._rows is None:
            parts_tables, parts_lens = [], []
            if self.num_prefill_tokens:
                tables, lens = kernels.prefill_rows(self.prefill_block_tables, self.prefill_cu_seqlens,
                                                    self.prefill_context_lens)
                parts_tables.append(tables)
                parts_lens.append(lens)
            if self.decode_context_lens.numel():
                parts_tables.append(self.decode_block_tables)
                parts_lens.append(self.decode_context_lens)
            width = max(t.shape[1] for t in parts_tables)
            tables = torch.cat([F.pad(t, (0, width - t.shape[1])) for t in parts_tables])
            self._rows = tables, torch.cat(parts_lens)
        return self._rows


@dataclass
class ForwardState:
    """A forward pass in progress: the hidden states after ``next_layer`` layers."""

    x: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    batch: AttentionBatch
    next_layer: int = 0
    cos_local: torch.Tensor | None = None  # sliding layers' own RoPE (Gemma 3), else None
    sin_local: torch.Tensor | None = None
    logit_rows: torch.Tensor | None = None  # int64 rows that sample: the fused path's head computes their logits
    logits: torch.Tensor | None = None  # float32 [len(logit_rows), vocab], uncapped, once the fused head ran


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))  # host: the loader fills and moves it

    def forward(self, x, residual=None):
        """RMSNorm of ``x``; with ``residual``: ``(RMSNorm(x + residual), x + residual)``."""
        normed, total = kernels.rms_norm(x, self.weight, self.eps, residual)
        return normed if residual is None else (normed, total)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.scale = config.query_scale or self.head_dim ** -0.5
        self.softcap = config.attn_softcap or 0.0
        self.window = config.layer_windows[layer]
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm

    def forward(self, x, cos, sin, kv_cache, batch: AttentionBatch):
        q = self._rope_and_cache(self.qkv_proj(x, batch.wide_rows, batch.lora_slots), cos, sin, kv_cache, batch)
        k_cache, v_cache = kv_cache
        out = kernels.attention_by_row(q, k_cache, v_cache, *batch.rows(), self.scale, self.window, self.softcap)
        if out is not None:
            return self.o_proj(out.reshape(-1, self.q_size), batch.wide_rows, batch.lora_slots)
        p = batch.num_prefill_tokens
        parts = []
        if p:
            parts.append(kernels.prefill_attention(q[:p], k_cache, v_cache, batch.prefill_block_tables,
                                                   batch.prefill_cu_seqlens, batch.prefill_context_lens, self.scale,
                                                   self.window, self.softcap))
        if p < q.shape[0]:
            parts.append(kernels.decode_attention(q[p:], k_cache, v_cache, batch.decode_block_tables,
                                                  batch.decode_context_lens, self.scale, self.window, self.softcap))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self.o_proj(out.reshape(-1, self.q_size), batch.wide_rows, batch.lora_slots)

    def _rope_and_cache(self, qkv, cos, sin, kv_cache, batch: AttentionBatch):
        """The queries ``[T, Hq, D]`` after RoPE; this step's keys (after RoPE) and values go to the cache."""
        if not self.qk_norm and kernels.try_rope_and_cache(qkv, cos, sin, self.num_heads, self.num_kv_heads,
                                                           *kv_cache, batch.slot_mapping):
            return qkv[:, :self.q_size].view(-1, self.num_heads, self.head_dim)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        kernels.reshape_and_cache(k, v.view(-1, self.num_kv_heads, self.head_dim), *kv_cache, batch.slot_mapping)
        return q


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = config.hidden_act

    def forward(self, x, wide_rows: int = 0, lora_slots: torch.Tensor | None = None):
        gate, up = self.gate_up_proj(x, wide_rows, lora_slots).chunk(2, dim=-1)
        if self.act == "silu":
            gate = F.silu(gate)
        else:
            gate = F.gelu(gate, approximate="tanh" if self.act == "gelu_tanh" else "none")
        return self.down_proj(gate * up, wide_rows, lora_slots)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)  # the MLP's input norm
        self.mlp = MLP(config)
        self.sandwich_norm = config.sandwich_norm
        if config.sandwich_norm:
            self.attn_output_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.mlp_output_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.local_rope = bool(config.rope_theta_local and self.self_attn.window)
        self.reduce = None  # tensor parallel: sums the ranks' partial block outputs (models/tp_weights.py)

    def forward(self, x, state: "ForwardState", kv_cache):
        cos, sin = (state.cos_local, state.sin_local) if self.local_rope else (state.cos, state.sin)
        h = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, state.batch)
        if self.reduce is not None:
            h = self.reduce(h)
        if self.sandwich_norm:
            h = self.attn_output_norm(h)
        normed, x = self.post_attention_layernorm(x, residual=h)
        h = self.mlp(normed, state.batch.wide_rows, state.batch.lora_slots)
        if self.reduce is not None:
            h = self.reduce(h)
        if self.sandwich_norm:
            h = self.mlp_output_norm(h)
        return x + h


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.lm_head_rows or config.vocab_size, bias=False)
        self.embedding_scale = config.hidden_size ** 0.5 if config.scale_embeddings else None
        # the RoPE tables are built on the model's device by build_model: computed here, on the meta
        # device, torch's reference arange pulls in torch._dynamo and with it triton (66 MiB of RSS)
        self.register_buffer("rope", None, persistent=False)
        self.register_buffer("rope_local", None, persistent=False)
        self.fused_decode = True  # steps may run a few layers a C++ call (models/fused_decode.py)
        self._decode_weights: fused_decode.DecodeWeights | None | bool = False  # False: not gathered yet
        self.adapters: AdapterTable | None = None  # its LoRA adapters, once one is loaded (lora_table.py)

    def _apply(self, fn, recurse=True):
        self._decode_weights = False  # the gathered weights are the old tensors
        moved = super()._apply(fn, recurse)
        if self.adapters is not None:  # the stacks are plain tensors: rebuilt on the model's new device
            self.adapters.rebuild()
        return moved

    def adapter_table(self, base_name: str) -> AdapterTable:
        if self.adapters is None:
            self.adapters = AdapterTable(self, base_name)
        return self.adapters

    @torch.inference_mode()
    def forward(self, input_ids, positions, kv_caches, batch: AttentionBatch):
        """Final hidden states ``[T, hidden]`` (normed) for every input token."""
        state = self.start(input_ids, positions, batch)
        self.run_layers(state, kv_caches)
        return self.finish(state)

    @torch.inference_mode()
    def start(self, input_ids, positions, batch: AttentionBatch) -> "ForwardState":
        """A forward pass ready to run its first layer."""
        x = self.embed_tokens(input_ids, self.norm.weight.dtype)
        if self.embedding_scale is not None:  # in the activations' dtype, as transformers rounds it
            x = x * torch.tensor(self.embedding_scale, dtype=x.dtype, device=x.device)
        cos_sin = self.rope[positions].to(x.dtype)
        state = ForwardState(x, cos_sin[:, 0, None, :], cos_sin[:, 1, None, :], batch)
        if self.rope_local is not None:
            local = self.rope_local[positions].to(x.dtype)
            state.cos_local, state.sin_local = local[:, 0, None, :], local[:, 1, None, :]
        return state

    @torch.inference_mode()
    def run_layers(self, state: "ForwardState", kv_caches, should_pause=None) -> bool:
        """Run layers until the last one (True) or until ``should_pause()`` says so after a layer (False).

        A paused pass resumes with the next call; meanwhile other sequences may run, since a pass
        only writes its own tokens' cache slots. Where the model allows, a few layers run a call
        (models/fused_decode.py), and the pass may pause between two calls.
        """
        if self.fused_decode and state.next_layer < len(self.layers):
            if self._decode_weights is False:
                self._decode_weights = fused_decode.decode_weights(self)
            if self._decode_weights is not None:
                done = fused_decode.run(self._decode_weights, state, kv_caches, should_pause, self.adapters)
                if done is not None:
                    return done
        while state.next_layer < len(self.layers):
            i = state.next_layer
            state.x = self.layers[i](state.x, state, kv_caches[i])
            state.next_layer = i + 1
            if should_pause is not None and state.next_layer < len(self.layers) and should_pause():
                return False
        return True

    @torch.inference_mode()
    def finish(self, state: "ForwardState"):
        return self.norm(state.x)

    @torch.inference_mode()
    def logits(self, hidden, rows=None):
        """float32 logits of ``hidden[rows]`` (all rows when None)."""
        return self.capped(self.lm_head(hidden if rows is None else hidden[rows]).float())

    def capped(self, logits):
        """The final soft cap (Gemma 2) of the LM head's output, where the model has one."""
        cap = self.config.final_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap


def fuse_hf_state_dict(state: dict, config: ModelConfig) -> dict:
    """Map Hugging Face parameter names onto this module, fusing q/k/v and gate/up (dense or quantized)."""
    out = {}
    for name, tensor in state.items():
        key = name.removeprefix("model.")
        if ".self_attn.q_proj." in key or ".self_attn.k_proj." in key or ".self_attn.v_proj." in key:
            continue
        if ".mlp.gate_proj." in key or ".mlp.up_proj." in key:
            continue
        if key == "rope_freqs" or key.endswith("rotary_emb.inv_freq"):
            continue
        out[key] = tensor
    for i in range(config.num_layers):
        p = f"model.layers.{i}"
        for suffix in ("weight", "bias"):
            parts = [state.get(f"{p}.self_attn.{n}_proj.{suffix}") for n in "qkv"]
            if all(t is not None for t in parts):
                out[f"layers.{i}.self_attn.qkv_proj.{suffix}"] = stack_rows(parts)
        gate, up = state.get(f"{p}.mlp.gate_proj.weight"), state.get(f"{p}.mlp.up_proj.weight")
        if gate is not None and up is not None:  # Phi-3 ships them fused already
            out[f"layers.{i}.mlp.gate_up_proj.weight"] = stack_rows([gate, up])
    if "lm_head.weight" not in out:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return out


def build_model(config: ModelConfig, state: dict, dtype: torch.dtype, device: str,
                weight_dtype: torch.dtype | None = None) -> LlamaModel:
    """The model on ``device`` from Hugging Face-named weights.

    Activations, norms and embeddings run in ``dtype``. A linear weight given quantized
    (``gpushare.models.quantized``) stays so; a dense one is cast to ``weight_dtype`` (default
    ``dtype``). A quantized lm_head tied to the embedding serves both: lookups dequantize rows.
    """
    with torch.device("meta"):
        model = LlamaModel(config)
    fused = fuse_hf_state_dict(state, config)
    expected = set(model.state_dict().keys())
    missing = expected - set(fused)
    if missing:
        raise ValueError(f"model weights are missing {sorted(missing)[:5]}{' ...' if len(missing) > 5 else ''}")
    unexpected = set(fused) - expected
    if unexpected:
        raise ValueError(f"unexpected weights {sorted(unexpected)[:5]}")
    shapes = model.state_dict()
    for name, value in fused.items():
        if tuple(value.shape) != tuple(shapes[name].shape):
            raise ValueError(f"weight {name} has shape {list(value.shape)}, the model's config needs "
                             f"{list(shapes[name].shape)}")
    tied = fused["lm_head.weight"] is fused["embed_tokens.weight"]
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        weight = fused.pop(f"{name}.weight")
        if isinstance(weight, torch.Tensor):
            module.set_dense(weight.to(device=device, dtype=weight_dtype or dtype))
        else:
            module.set_quantized(weight, device)
        if module.bias is not None:
            module.bias = nn.Parameter(fused.pop(f"{name}.bias").to(device=device, dtype=dtype), requires_grad=False)
    embedding = fused.pop("embed_tokens.weight")
    if tied and model.lm_head.format.startswith("int8"):
        model.embed_tokens.row_lookup = model.lm_head.dequantized_rows
        model.embed_tokens.weight = None
    elif tied and model.lm_head.format == "dense" and model.lm_head.weight.dtype == dtype:
        model.embed_tokens.weight = model.lm_head.weight
    elif isinstance(embedding, Int8Weight):  # a tensor-parallel rank's lm_head holds part of it: keep it int8
        model.embed_tokens.set_quantized(embedding, device)
    else:
        dense = embedding if isinstance(embedding, torch.Tensor) else embedding.dequantize()
        model.embed_tokens.weight = nn.Parameter(dense.to(device=device, dtype=dtype), requires_grad=False)
    model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in fused.items()}, strict=False, assign=True)
    model.rope = rope_table(config, state.get("rope_freqs")).to(device)
    if config.rope_theta_local:
        model.rope_local = rope_table(config, local=True).to(device)
    return model.eval()


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights occupy as stored: dense, packed and quantized forms, shared tensors once."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    total += sum(m.qweight.nbytes + m.scales.nbytes for m in model.modules()
                 if isinstance(m, Embedding) and hasattr(m, "qweight"))  # int8 rows of their own
    return total + sum(linear_bytes(m) for m in model.modules() if isinstance(m, Linear) and m.format != "dense")
