"""EncoderConfig: what a BERT-family encoder (BERT, RoBERTa / XLM-RoBERTa, nomic-bert) is, read from a
Hugging Face ``config.json`` or GGUF metadata in llama.cpp's layout (``bert``, ``nomic-bert``).

Torch-free: the supervisor reads it for listings, limits and the model's kind. An encoder holds no KV
cache; its ``kind`` says what it serves: ``embedding`` (a bare encoder) or ``rerank`` (a cross-encoder,
``*ForSequenceClassification`` with one label).
"""

from dataclasses import dataclass

from gpushare.catalog.model_config import bounded

MAX_TYPE_VOCAB = 1 << 10  # BERT's token types: 2 in every released model; a crafted file may claim 2**40

# HF model_type -> our arch name (llama.cpp's GGUF architecture names where it has one).
_HF_ARCHS = {"bert": "bert", "roberta": "xlm-roberta", "xlm-roberta": "xlm-roberta", "nomic_bert": "nomic-bert"}
GGUF_ENCODER_ARCHS = ("bert", "nomic-bert")
ENCODER_MODEL_TYPES = tuple(_HF_ARCHS)
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "silu": "silu",
                "swish": "silu", "relu": "relu"}


@dataclass
class EncoderConfig:
    arch: str  # bert | xlm-roberta | nomic-bert
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    context_length: int  # positions an input may use (RoBERTa's offset taken off)
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    position_offset: int = 0  # RoBERTa numbers positions from padding_idx + 1
    rotary: bool = False  # nomic-bert: RoPE instead of learned positions, gated (SwiGLU) MLP, no biases
    rope_theta: float = 10000.0
    num_labels: int = 0  # 1: a cross-encoder (relevance score); 0: a bare encoder
    is_encoder: bool = True  # what the engine and the registry tell an encoder from a decoder by

    def __post_init__(self):
        # The same caps as a decoder's (model_config.LIMITS), checked before anything is sized by them:
        # a crafted header's 2e9 layers or 2**40 positions must not become tables in memory.
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "context_length"):
            bounded(name, getattr(self, name), name)
        if not 1 <= self.type_vocab_size <= MAX_TYPE_VOCAB:
            raise ValueError(f"type_vocab_size {self.type_vocab_size} is out of range (1 to {MAX_TYPE_VOCAB})")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads

    @property
    def kind(self) -> str:
        return "rerank" if self.num_labels == 1 else "embedding"

    kv_window = None  # no KV cache, no window


def is_encoder_hf(raw: dict) -> bool:
    return raw.get("model_type") in _HF_ARCHS


def is_encoder_gguf(meta: dict) -> bool:
    return meta.get("general.architecture") in GGUF_ENCODER_ARCHS


def _activation(name: str) -> str:
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported encoder activation {name!r} (supported: {', '.join(_ACTIVATIONS)})")
    return _ACTIVATIONS[name]


def _labels(raw: dict) -> int:
    """1 for a ``*ForSequenceClassification`` with one label; refuses other classifier heads."""
    architectures = raw.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        return 0
    labels = raw.get("num_labels") or len(raw.get("id2label") or {}) or 2
    if labels != 1:
        raise ValueError(f"a sequence classifier with {labels} labels is not supported (cross-encoders with one "
                         "label only: their logit is the relevance score)")
    return 1


def encoder_config_from_hf(raw: dict) -> EncoderConfig:
    arch = _HF_ARCHS[raw["model_type"]]
    if raw.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"position_embedding_type {raw['position_embedding_type']!r} is not supported (absolute)")
    if raw.get("is_decoder"):
        raise ValueError("a BERT-family model configured as a decoder (is_decoder) is not supported")
    offset = int(raw.get("pad_token_id", 1)) + 1 if arch == "xlm-roberta" else 0
    rotary = arch == "nomic-bert"
    if rotary:
        rope = raw.get("rope_parameters") or {"rope_theta": raw.get("rope_theta", 10000.0)}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"nomic-bert rope_type {rope['rope_type']!r} is not supported (default)")
        theta = float(rope.get("rope_theta", 10000.0))
        head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
        if head_dim * raw["num_attention_heads"] != raw["hidden_size"]:
            raise ValueError("nomic-bert with head_dim x heads != hidden_size is not supported")
    else:
        theta = 10000.0
    return EncoderConfig(
        arch=arch, vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"], num_layers=raw["num_hidden_layers"],
        num_heads=raw["num_attention_heads"],
        context_length=raw.get("max_position_embeddings", 512) - offset,
        type_vocab_size=raw.get("type_vocab_size", 2), layer_norm_eps=raw.get("layer_norm_eps", 1e-12),
        hidden_act=_activation(raw.get("hidden_act", "gelu")), position_offset=offset, rotary=rotary,
        rope_theta=theta, num_labels=_labels(raw))


def encoder_config_from_gguf(meta: dict) -> EncoderConfig:
    arch = meta["general.architecture"]

    def key(name, default=None):
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{name}")
        return value

    if meta.get(f"{arch}.attention.causal", False):
        raise ValueError(f"a causal {arch} GGUF is not supported (encoders attend both ways)")
    rotary = arch == "nomic-bert"
    return EncoderConfig(
        arch=arch, vocab_size=len(meta["tokenizer.ggml.tokens"]), hidden_size=int(key("embedding_length")),
        intermediate_size=int(key("feed_forward_length")), num_layers=int(key("block_count")),
        num_heads=int(key("attention.head_count")), context_length=int(key("context_length")),
        type_vocab_size=int(meta.get("tokenizer.ggml.token_type_count", 2)),
        layer_norm_eps=float(key("attention.layer_norm_epsilon", 1e-12)),
        hidden_act="silu" if rotary else "gelu", rotary=rotary,
        rope_theta=float(key("rope.freq_base", 1000.0 if rotary else 10000.0)),
        num_labels=1 if int(meta.get(f"{arch}.pooling_type", 0)) == 4 else 0)
