"""ModelConfig: the architecture numbers and features of a model, from GGUF metadata or config.json.

Every supported architecture is the one model in ``models/llama.py`` with some features switched
on (``ARCH_FEATURES``): Qwen3's q/k norms, Gemma's scaled embeddings, GeGLU, output norms and
soft-caps, sliding windows per layer, Phi-3's LongRoPE. A file asking for anything else (another
architecture, rope type, activation, partial rotary) is refused here, naming what it asked for and
what we support: a model is never loaded and run wrong.
"""

import math
from dataclasses import dataclass, field

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "smollm", "qwen3", "gemma", "gemma2", "gemma3", "phi3")
ROPE_TYPES = ("default", "linear", "llama3", "longrope")
ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
# Features each architecture switches on in the one model (defaults: Llama's).
_GEMMA = {"hidden_act": "gelu_tanh", "sandwich_norm": True, "scale_embeddings": True}
ARCH_FEATURES = {
    "qwen2": {"attention_bias": True},
    "qwen3": {"qk_norm": True},
    "gemma": {"hidden_act": "gelu_tanh", "scale_embeddings": True},
    "gemma2": _GEMMA,
    "gemma3": {**_GEMMA, "qk_norm": True},
}
# Hugging Face model_type -> our architecture name, where they differ.
_HF_ARCHS = {"gemma3_text": "gemma3"}
# Which layers slide when a file gives a window but no per-layer list: every ``period``-th layer is
# global (Gemma 2: 2, Gemma 3: 6, as llama.cpp and transformers both assume); other models: all slide.
_WINDOW_PERIOD = {"gemma2": 2, "gemma3": 6}
# What Gemma 3's multimodal config.json leaves out of its text_config: transformers' defaults.
_GEMMA3_TEXT_DEFAULTS = {"vocab_size": 262208, "head_dim": 256, "query_pre_attn_scalar": 256,
                         "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
                         "rope_local_base_freq": 10000.0, "sliding_window": 4096, "sliding_window_pattern": 6,
                         "hidden_activation": "gelu_pytorch_tanh", "num_attention_heads": 8,
                         "num_key_value_heads": 4, "tie_word_embeddings": True}
_HF_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
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
    # Architecture features (ARCH_FEATURES); the defaults are Llama's.
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE (Qwen3, Gemma 3)
    hidden_act: str = "silu"  # the MLP's gate: SwiGLU ("silu") or GeGLU ("gelu_tanh", Gemma; "gelu" exact)
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    sandwich_norm: bool = False  # norms on the attention and MLP outputs too (Gemma 2/3)
    query_scale: float | None = None  # attention scores' scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) before the softmax (Gemma 2)
    final_softcap: float | None = None  # the same on the logits
    layer_windows: list[int] = field(default_factory=list)  # per layer: sliding window in tokens, 0 = global
    rope_theta_local: float | None = None  # sliding layers' own unscaled RoPE base (Gemma 3)
    # The LM head's rows: a tensor-parallel rank's slice of the vocabulary, or 2 (yes_no_head); None: all.
    lm_head_rows: int | None = None
    # The LM head holds the "yes" and "no" rows only, in that order: a GGUF LLM reranker's cls.output, as
    # llama.cpp's converter writes Qwen3-Reranker (pooling_type 4, classifier.output_labels [yes, no]).
    yes_no_head: bool = False

    def __post_init__(self):
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported architecture {self.arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")
        for name, limit in LIMITS.items():
            value = getattr(self, name)
            if not 1 <= value <= limit:
                raise ValueError(f"{name} {value} is out of range (1 to {limit})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {self.hidden_act!r} (supported: {', '.join(ACTIVATIONS)})")
        kind = rope_type(self.rope_scaling)
        if kind not in ROPE_TYPES:
            raise ValueError(f"unsupported rope scaling {kind!r} (supported: {', '.join(ROPE_TYPES)})")
        if not self.layer_windows:
            self.layer_windows = [0] * self.num_layers
        if len(self.layer_windows) != self.num_layers or any(w < 0 for w in self.layer_windows):
            raise ValueError(f"sliding windows {self.layer_windows} do not give one window (>= 0) per layer")
        # A window as long as the context never cuts anything off.
        self.layer_windows = [w if w < self.context_length else 0 for w in self.layer_windows]

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @property
    def kv_window(self) -> int | None:
        """Tokens every layer still attends to behind the newest one, when all layers slide; None if
        any layer is global (then no KV block ever falls out of every layer's window)."""
        return max(self.layer_windows) if all(self.layer_windows) else None


def bounded(name: str, value: int, key: str) -> int:
    """``value`` when within LIMITS[name]; else a ValueError naming the file's key and the cap. Counts that
    size a list (layers' windows) are checked here, before that list is built: a crafted 2e8 layers
    would take gigabytes before ModelConfig's own check."""
    limit = LIMITS[name]
    if not 1 <= value <= limit:
        raise ValueError(f"{key} {value} is out of range (1 to {limit}, the cap on {name})")
    return value


def rope_type(scaling: dict) -> str:
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    return "longrope" if kind == "su" else kind  # early Phi-3 128k configs called LongRoPE "su"


def _windows(arch: str, num_layers: int, window: int | None, pattern=None) -> list[int]:
    """Per-layer windows from one window size and a pattern: a list of per-layer flags (True =
    sliding), a period (every period-th layer global), or None (the architecture's default)."""
    if not window:
        return [0] * num_layers
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ValueError(f"sliding_window_pattern has {len(pattern)} entries for {num_layers} layers")
        return [window if sliding else 0 for sliding in pattern]
    period = int(pattern or _WINDOW_PERIOD.get(arch, 0))
    return [window if not period or (i + 1) % period else 0 for i in range(num_layers)]


def config_from_gguf(meta: dict) -> ModelConfig:
    """Build the config from GGUF metadata keys (``{arch}.block_count`` and friends)."""
    arch = meta["general.architecture"]

    def key(name, default=None):
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{name}")
        return value

    num_heads = bounded("num_heads", int(key("attention.head_count")), f"{arch}.attention.head_count")
    hidden = int(key("embedding_length"))
    num_layers = bounded("num_layers", int(key("block_count")), f"{arch}.block_count")
    head_dim = int(meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count")
                   or hidden // num_heads)
    _refuse_gguf_features(meta, arch, head_dim)
    vocab = meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])
    scaling = {}
    scaling_type = meta.get(f"{arch}.rope.scaling.type")
    if scaling_type == "linear":
        scaling = {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
    elif arch == "phi3" and int(meta.get(f"{arch}.rope.scaling.original_context_length") or 0) not in (
            0, int(key("context_length"))):
        # LongRoPE (a context extended past the original one; Phi-3-mini-4k states both equal): the
        # short and long factors are the file's rope_factors_* tensors (loader.read_gguf).
        scaling = {"rope_type": "longrope",
                   "original_max_position_embeddings": int(meta[f"{arch}.rope.scaling.original_context_length"]),
                   "attention_factor": meta.get(f"{arch}.rope.scaling.attn_factor")}
    elif scaling_type not in (None, "none"):
        raise ValueError(f"unsupported rope scaling {scaling_type!r} in {arch}.rope.scaling.type "
                         f"(supported: none, linear)")
    features = dict(ARCH_FEATURES.get(arch, {}))
    if arch in ("gemma2", "gemma3"):
        # llama.cpp's rule (the file does not say): the 27B models scale queries by hidden / heads.
        big = num_layers == {"gemma2": 46, "gemma3": 62}[arch]
        features["query_scale"] = (hidden // num_heads if big else head_dim) ** -0.5
    if arch == "gemma3":
        features["rope_theta_local"] = float(meta.get(f"{arch}.rope.freq_base_swa", 10000.0))
    window = meta.get(f"{arch}.attention.sliding_window")
    if is_yes_no_reranker(meta):
        features.update(yes_no_head=True, lm_head_rows=2)
    return ModelConfig(
        arch=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        context_length=int(key("context_length")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        attn_softcap=meta.get(f"{arch}.attn_logit_softcapping"),
        final_softcap=meta.get(f"{arch}.final_logit_softcapping"),
        layer_windows=_windows(arch, num_layers, window, meta.get(f"{arch}.attention.sliding_window_pattern")),
        **features,
    )


def is_yes_no_reranker(meta: dict) -> bool:
    """A decoder GGUF that scores a yes/no token: pooling_type 4 (rank) with labels ["yes", "no"]."""
    arch = meta.get("general.architecture")
    return (int(meta.get(f"{arch}.pooling_type") or 0) == 4
            and list(meta.get(f"{arch}.classifier.output_labels") or []) == ["yes", "no"])


def _refuse_gguf_features(meta: dict, arch: str, head_dim: int) -> None:
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")
    rotary = meta.get(f"{arch}.rope.dimension_count")
    if rotary is not None and int(rotary) != head_dim:
        raise ValueError(f"partial rotary embeddings ({arch}.rope.dimension_count {rotary} of head size "
                         f"{head_dim}) are not supported (only RoPE over the whole head)")
    value_length = meta.get(f"{arch}.attention.value_length")
    if value_length is not None and int(value_length) != head_dim:
        raise ValueError(f"{arch}.attention.value_length {value_length} differs from key_length {head_dim}: "
                         "not supported (keys and values of one size only)")
    if meta.get(f"{arch}.expert_count"):
        raise ValueError(f"mixture-of-experts models ({arch}.expert_count) are not supported")


def config_from_hf(raw: dict) -> ModelConfig:
    """Build the config from a Hugging Face ``config.json`` dict."""
    model_type = raw.get("model_type", "llama")
    if model_type == "gemma3":  # the multimodal checkpoints (4B and up): their text model
        if "text_config" not in raw:
            raise ValueError("a gemma3 config.json without text_config is not supported (supported: gemma3 "
                             "with its text_config, gemma3_text)")
        raw = {**_GEMMA3_TEXT_DEFAULTS, **raw["text_config"], "model_type": "gemma3_text"}
        model_type = "gemma3_text"
    arch = _HF_ARCHS.get(model_type, model_type)
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported architecture {model_type!r} (supported: {', '.join(SUPPORTED_ARCHS)})")
    num_heads = raw["num_attention_heads"]
    hidden = raw["hidden_size"]
    head_dim = raw.get("head_dim") or hidden // num_heads
    global_rope, local_rope = _hf_rope(raw)
    features = dict(ARCH_FEATURES.get(arch, {}))
    features["hidden_act"] = _hf_activation(raw)
    if arch in ("gemma2", "gemma3"):
        features["query_scale"] = float(raw.get("query_pre_attn_scalar", head_dim)) ** -0.5
    if arch == "gemma3":
        features["rope_theta_local"] = float(local_rope.get("rope_theta", 10000.0))
        if rope_type(local_rope) != "default":
            raise ValueError(f"unsupported rope scaling {rope_type(local_rope)!r} on sliding layers (supported: default)")
    if raw.get("mlp_bias"):
        raise ValueError("mlp_bias is not supported (MLPs without bias only)")
    if raw.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention is not supported (causal attention only)")
    scaling = {k: v for k, v in global_rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if rope_type(scaling) == "longrope":
        scaling.setdefault("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    return ModelConfig(
        arch=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        context_length=raw.get("max_position_embeddings", 4096),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
        rope_theta=float(global_rope.get("rope_theta", 10000.0)),
        rope_scaling=scaling if rope_type(scaling) != "default" else {},
        attention_bias=raw.get("attention_bias", arch == "qwen2"),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        attn_softcap=raw.get("attn_logit_softcapping"),
        final_softcap=raw.get("final_logit_softcapping"),
        layer_windows=_hf_windows(raw, arch),
        **features,
    )


def _hf_rope(raw: dict) -> tuple[dict, dict]:
    """(global layers' rope parameters, sliding layers' ones), from ``rope_parameters`` (transformers 5,
    per layer type for Gemma 3) or the older ``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq``."""
    params = raw.get("rope_parameters")
    if params and "full_attention" in params:
        return dict(params["full_attention"]), dict(params.get("sliding_attention") or {})
    merged = {"rope_theta": raw.get("rope_theta", 10000.0), **(raw.get("rope_scaling") or {}), **(params or {})}
    partial = merged.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor {partial} is not supported (only RoPE over the whole head, 1.0)")
    return merged, {"rope_theta": raw.get("rope_local_base_freq", 10000.0)}


def _hf_activation(raw: dict) -> str:
    name = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
    if name not in _HF_ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r} (supported: {', '.join(_HF_ACTIVATIONS)})")
    return _HF_ACTIVATIONS[name]


def _hf_windows(raw: dict, arch: str) -> list[int]:
    window = raw.get("sliding_window")
    if raw.get("use_sliding_window") is False:
        window = None
    layer_types = raw.get("layer_types")
    if layer_types is None:
        return _windows(arch, bounded("num_layers", int(raw["num_hidden_layers"]), "num_hidden_layers"), window,
                        raw.get("sliding_window_pattern"))
    unknown = set(layer_types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise ValueError(f"unsupported layer_types {sorted(unknown)} (supported: full_attention, sliding_attention)")
    return _windows(arch, len(layer_types), window, [t == "sliding_attention" for t in layer_types])


def longrope_attention_factor(scaling: dict, context_length: int) -> float:
    """LongRoPE's cos/sin multiplier: given, or sqrt(1 + ln(s) / ln(original)) for the extension s."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or context_length / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
