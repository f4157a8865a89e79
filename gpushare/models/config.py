"""ModelConfig: the architecture numbers of a Llama-family model, from GGUF metadata or config.json."""

from dataclasses import dataclass, field

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "smollm")
# Bounds on the numbers a model file states, checked before anything is sized by them (rope tables
# by context_length, layers by num_layers): far above any real model, far below a crafted file's 2**63.
LIMITS = {"vocab_size": 1 << 22, "hidden_size": 1 << 17, "intermediate_size": 1 << 19, "num_layers": 1024,
          "num_heads": 1024, "num_kv_heads": 1024, "head_dim": 1024, "context_length": 1 << 22}


@dataclass
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    context_length: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)
    attention_bias: bool = False
    tie_word_embeddings: bool = False

    def __post_init__(self):
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported architecture {self.arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")
        for name, limit in LIMITS.items():
            value = getattr(self, name)
            if not 1 <= value <= limit:
                raise ValueError(f"{name} {value} is out of range (1 to {limit})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def config_from_gguf(meta: dict) -> ModelConfig:
    """Build the config from GGUF metadata keys (``{arch}.block_count`` and friends)."""
    arch = meta["general.architecture"]

    def key(name, default=None):
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{name}")
        return value

    num_heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count") or hidden // num_heads)
    vocab = meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])
    scaling = {}
    scaling_type = meta.get(f"{arch}.rope.scaling.type")
    if scaling_type == "linear":
        scaling = {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
    return ModelConfig(
        arch=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        context_length=int(key("context_length")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        attention_bias=arch == "qwen2",
    )


def config_from_hf(raw: dict) -> ModelConfig:
    """Build the config from a Hugging Face ``config.json`` dict."""
    model_type = raw.get("model_type", "llama")
    num_heads = raw["num_attention_heads"]
    return ModelConfig(
        arch=model_type,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
        context_length=raw.get("max_position_embeddings", 4096),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
        rope_theta=raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        rope_scaling=raw.get("rope_scaling") or {},
        attention_bias=raw.get("attention_bias", model_type == "qwen2"),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
    )
