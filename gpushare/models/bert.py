"""The BERT-family encoder (BERT, RoBERTa / XLM-RoBERTa, nomic-bert) and its cross-encoder head.

One post-norm transformer with bidirectional attention over a padded batch; ``EncoderConfig`` says
what differs: learned absolute positions (RoBERTa's numbered from padding_idx + 1) or RoPE with a
gated MLP and no biases (nomic-bert). No KV cache: an input is read whole in one pass.

Weights are held under llama.cpp's GGUF tensor names (``hf_encoder_name`` maps a Hugging Face
checkpoint's onto them), so both formats build the same module. Dense weights only (fp32 / bf16 / fp16).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gpushare.catalog.encoder_config import EncoderConfig

_LAYER_NAMES = {  # Hugging Face name inside a layer -> llama.cpp's
    "attention.self.query": "attn_q", "attention.self.key": "attn_k", "attention.self.value": "attn_v",
    "attention.output.dense": "attn_output", "attention.output.LayerNorm": "attn_output_norm",
    "intermediate.dense": "ffn_up", "output.dense": "ffn_down", "output.LayerNorm": "layer_output_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",  # nomic-bert
    "self_attn.o_proj": "attn_output", "post_attention_layernorm": "attn_output_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "post_mlp_layernorm": "layer_output_norm",
    "attn.Wqkv": "attn_qkv", "attn.out_proj": "attn_output", "mlp.fc11": "ffn_up", "mlp.fc12": "ffn_gate",
    "mlp.fc2": "ffn_down", "norm1": "attn_output_norm", "norm2": "layer_output_norm",  # nomic-bert as saved
}
_GLOBAL_NAMES = {
    "embeddings.word_embeddings": "token_embd", "embeddings.position_embeddings": "position_embd",
    "embeddings.token_type_embeddings": "token_types", "embeddings.LayerNorm": "token_embd_norm",
    "emb_ln": "token_embd_norm",
    # The cross-encoder head: BERT's pooler + classifier, RoBERTa's classifier.dense + out_proj (both
    # dense -> tanh -> one logit on the first token), as llama.cpp's cls / cls.output.
    "pooler.dense": "cls", "classifier.dense": "cls", "classifier.out_proj": "cls.output", "classifier": "cls.output",
}
_ACTS = {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu, "relu": F.relu}


def hf_encoder_name(name: str) -> str | None:
    """A Hugging Face tensor name as llama.cpp names it; None for tensors the encoder does not use."""
    for prefix in ("bert.", "roberta.", "nomic_bert.", "model."):
        name = name.removeprefix(prefix)
    stem, _, kind = name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{kind}"
    parts = stem.split(".")
    if parts[0] in ("encoder", "layers"):
        if parts[0] == "encoder":
            parts = parts[1:]  # encoder.layer.N.* -> layer.N.*
        if len(parts) > 2 and parts[1].isdigit() and ".".join(parts[2:]) in _LAYER_NAMES:
            return f"blk.{parts[1]}.{_LAYER_NAMES['.'.join(parts[2:])]}.{kind}"
    return None


def _linear(state: dict, name: str, dtype, device) -> nn.Linear:
    weight = state.pop(f"{name}.weight")
    bias = state.pop(f"{name}.bias", None)
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(weight.to(device, dtype), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.to(device, dtype), requires_grad=False)
    return layer


def _norm(state: dict, name: str, eps: float, dtype, device) -> nn.LayerNorm:
    weight = state.pop(f"{name}.weight")
    norm = nn.LayerNorm(weight.shape[0], eps=eps, device="meta")
    norm.weight = nn.Parameter(weight.to(device, dtype), requires_grad=False)
    norm.bias = nn.Parameter(state.pop(f"{name}.bias", torch.zeros_like(weight)).to(device, dtype),
                             requires_grad=False)
    return norm


def _table(state: dict, name: str, dtype, device) -> nn.Parameter:
    return nn.Parameter(state.pop(name).to(device, dtype), requires_grad=False)


class EncoderLayer(nn.Module):
    def __init__(self, config: EncoderConfig, state: dict, i: int, dtype, device):
        super().__init__()
        p, eps = f"blk.{i}.", config.layer_norm_eps
        if f"{p}attn_qkv.weight" in state:  # nomic-bert's GGUF: q, k and v stacked
            for name in ("weight", "bias"):
                fused = state.pop(f"{p}attn_qkv.{name}", None)
                if fused is not None:
                    for part, value in zip(("attn_q", "attn_k", "attn_v"), fused.chunk(3, dim=0)):
                        state[f"{p}{part}.{name}"] = value
        self.q, self.k, self.v = (_linear(state, f"{p}{n}", dtype, device) for n in ("attn_q", "attn_k", "attn_v"))
        self.o = _linear(state, f"{p}attn_output", dtype, device)
        self.attn_norm = _norm(state, f"{p}attn_output_norm", eps, dtype, device)
        self.gate = _linear(state, f"{p}ffn_gate", dtype, device) if f"{p}ffn_gate.weight" in state else None
        self.up = _linear(state, f"{p}ffn_up", dtype, device)
        self.down = _linear(state, f"{p}ffn_down", dtype, device)
        self.out_norm = _norm(state, f"{p}layer_output_norm", eps, dtype, device)
        self.act = _ACTS[config.hidden_act]
        self.num_heads = config.num_heads

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor, rope) -> torch.Tensor:
        """``x`` [B, L, H]; ``key_mask`` [B, 1, 1, L] True where a key is a real token."""
        b, length, _ = x.shape
        q, k, v = (proj(x).view(b, length, self.num_heads, -1).transpose(1, 2) for proj in (self.q, self.k, self.v))
        if rope is not None:
            q, k = _rotate(q, *rope), _rotate(k, *rope)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        x = self.attn_norm(x + self.o(attn.transpose(1, 2).reshape(b, length, -1)))
        h = self.act(self.gate(x)) * self.up(x) if self.gate is not None else self.act(self.up(x))
        return self.out_norm(x + self.down(h))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE over the whole head, halves rotated (NeoX order, as nomic-bert and llama.cpp's nomic-bert)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@dataclass
class EncoderPass:
    """A forward pass in progress: the hidden states ``[B, L, H]`` after ``next_layer`` layers (the
    engine runs a few layers a loop turn while streams generate, engine/embed_queue.py)."""
    x: torch.Tensor
    key_mask: torch.Tensor  # [B, 1, 1, L] True where a key is a real token
    rope: tuple | None  # (cos, sin) of a rotary encoder, else None
    next_layer: int = 0


class EncoderModel(nn.Module):
    def __init__(self, config: EncoderConfig, state: dict, dtype=torch.float32, device: str = "cpu"):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device = device
        self.token_embd = _table(state, "token_embd.weight", dtype, device)
        self.position_embd = _table(state, "position_embd.weight", dtype, device) if not config.rotary else None
        self.token_types = _table(state, "token_types.weight", dtype, device) if "token_types.weight" in state else None
        self.embd_norm = _norm(state, "token_embd_norm", config.layer_norm_eps, dtype, device)
        self.layers = nn.ModuleList(EncoderLayer(config, state, i, dtype, device) for i in range(config.num_layers))
        if config.num_labels:
            if "cls.output.weight" not in state:
                raise ValueError("a cross-encoder without its classifier weights (classifier / cls.output)")
            self.cls = _linear(state, "cls", dtype, device) if "cls.weight" in state else None
            self.cls_out = _linear(state, "cls.output", dtype, device)
        if config.rotary:
            head = config.head_dim
            self.inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, head, 2, dtype=torch.float32, device=device)
                                                        / head)

    def forward(self, ids: list[list[int]], type_ids: list[list[int]] | None = None) -> torch.Tensor:
        """Last hidden states ``[B, L, H]`` of inputs padded to the longest (rows past an input's end are junk)."""
        state = self.start(ids, type_ids)
        self.run_layers(state, len(self.layers))
        return state.x

    def run_layers(self, state: "EncoderPass", count: int) -> bool:
        """Up to ``count`` more layers of the pass; whether it has run them all."""
        end = min(len(self.layers), state.next_layer + count)
        for layer in self.layers[state.next_layer:end]:
            state.x = layer(state.x, state.key_mask, state.rope)
        state.next_layer = end
        return end == len(self.layers)

    def start(self, ids: list[list[int]], type_ids: list[list[int]] | None = None) -> "EncoderPass":
        """A pass over inputs padded to the longest, through the embeddings, before its first layer."""
        length = max(len(x) for x in ids)
        dev = self.device
        tokens = torch.tensor([x + [0] * (length - len(x)) for x in ids], dtype=torch.long, device=dev)
        types = torch.tensor([t + [0] * (length - len(t)) for t in type_ids] if type_ids else
                             [[0] * length] * len(ids), dtype=torch.long, device=dev)
        lengths = torch.tensor([len(x) for x in ids], device=dev)
        key_mask = (torch.arange(length, device=dev)[None, :] < lengths[:, None])[:, None, None, :]
        x = self.token_embd[tokens]
        if self.token_types is not None:  # one row (RoBERTa): no second segment, every token is type 0
            x = x + self.token_types[types.clamp_(max=self.token_types.shape[0] - 1)]
        rope = None
        if self.position_embd is not None:
            x = x + self.position_embd[torch.arange(length, device=dev) + self.config.position_offset]
        else:
            freqs = torch.outer(torch.arange(length, device=dev, dtype=torch.float32), self.inv_freq)
            angles = torch.cat((freqs, freqs), dim=-1)
            rope = (angles.cos().to(self.dtype), angles.sin().to(self.dtype))
        return EncoderPass(self.embd_norm(x), key_mask, rope)

    def relevance(self, hidden: torch.Tensor) -> torch.Tensor:
        """A cross-encoder's score per input ``[B]``: its one logit on the first token, through a sigmoid
        (as sentence-transformers' CrossEncoder and vLLM's /score give it for one label)."""
        first = hidden[:, 0]
        if self.cls is not None:
            first = torch.tanh(self.cls(first))
        return torch.sigmoid(self.cls_out(first).float()[:, 0])
