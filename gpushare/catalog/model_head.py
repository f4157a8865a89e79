"""LoadedModel, and a model's head: everything of it but the weights (config, tokenizer, chat template,
stop ids, metadata), read from a GGUF header or a Hugging Face folder's JSON and tokenizer files.

Torch-free: the daemon's supervisor tokenises, renders chat and checks limits with a head while the
weights live in an engine worker process (models/loader.py builds those). ``grammar_vocab`` is the vocabulary as llguidance sees it, for output grammars and
the exact bytes of logprobs.
"""

import os
import threading
from dataclasses import dataclass, field

from gpushare.catalog.encoder_config import (EncoderConfig, encoder_config_from_gguf, encoder_config_from_hf,
                                             is_encoder_gguf, is_encoder_hf)
from gpushare.catalog.ggml_types import FILE_TYPE_NAMES
from gpushare.catalog.gguf_reader import open_gguf
from gpushare.catalog.tokenise_child import tokenised
from gpushare.catalog.model_config import ModelConfig, config_from_gguf, config_from_hf
from gpushare.catalog.model_files import read_json, read_text
from gpushare.catalog.pooling import RANK, Pooling, pooling_from_dir, pooling_from_gguf
from gpushare.catalog.tokenizer import Tokenizer, tokenizer_from_dir, tokenizer_from_gguf

DTYPE_NAMES = ("float32", "bfloat16", "float16")
_vocab_lock = threading.Lock()
_OUTPUT_TENSORS = ("token_embd.weight", "output.weight")  # GGUF names
# Chat models end a turn with one of these even when the metadata names another EOS.
_TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "</s>", "<end_of_turn>",
                    "<|end|>")
# gpt-oss's vocabulary ("harmony", api/channels.py): <|end|> ends a message (the thinking), <|return|> and
# <|call|> end the turn.
_HARMONY_TURN_ENDS = ("<|return|>", "<|call|>")


@dataclass
class LoadedModel:
    name_or_path: str
    config: ModelConfig | EncoderConfig
    model: object  # the LlamaModel (models/llama.py) or EncoderModel (models/bert.py); None in a head
    tokenizer: Tokenizer
    template_source: str | None
    stop_token_ids: set
    dtype: object  # activations and KV: a torch.dtype (load_model); its name in a head (load_model_head)
    device: str
    metadata: dict = field(default_factory=dict)
    weights: str = "float32"  # the weight format it was built in (gpushare.protocol.weight_format)
    kernel: str = ""  # the kernels its linears run on (models/linear.Linear.kernel), once built
    _template: object = None
    grammar_vocab: object = None  # llguidance's view of the tokenizer, built on first constrained request
    whole_config: ModelConfig | None = None  # tensor parallel: the whole model's (``config`` is this rank's)
    weight_bytes: int = 0  # its weights as stored, once built (models/llama.weight_bytes); 0 in a head
    pooling: Pooling = field(default_factory=Pooling)  # how its embeddings are pooled (catalog/pooling.py)

    @property
    def kind(self) -> str:
        """What it serves: "chat" (a decoder; it embeds too), "embedding" or "rerank"."""
        return model_kind(self.config, self.pooling)

    @property
    def pair_op(self) -> str:
        """How a reranker reads a (query, document) pair (catalog/tokenise_child.tokenised): a
        cross-encoder's framed pair with its token types, or an LLM reranker's prompt (catalog/llm_rerank.py)."""
        return "pairs" if getattr(self.config, "is_encoder", False) else "prompts"

    def pair_inputs(self, pairs: list[tuple[str, str]], max_tokens: int) -> list[tuple[list[int], list[int] | None]]:
        """A reranker's input for each (query, document), cut to ``max_tokens``."""
        return tokenised(self.tokenizer, self.pair_op, pairs, max_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        from gpushare.catalog import chat_template  # Jinja2: imported where templates render, not in a worker

        if self._template is None:
            self._template = chat_template.compile_template(self.template_source)
        return chat_template.render(self._template, messages, self.tokenizer.bos_token, self.tokenizer.eos_token,
                                    add_generation_prompt=add_generation_prompt, **extra)


def grammar_vocab(loaded) -> "llguidance.LLTokenizer":  # noqa: F821 (imported on first use)
    """The model's vocabulary as llguidance sees it (built once per loaded model, ~0.2 s). llguidance is
    imported here, at a process's first grammar: ~2.5 MiB of resident memory that a daemon serving
    no structured output does not hold."""
    import llguidance

    with _vocab_lock:
        if loaded.grammar_vocab is None:
            tokenizer = loaded.tokenizer
            loaded.grammar_vocab = llguidance.LLTokenizer(
                tokenizer.hf.to_str(), n_vocab=max(tokenizer.vocab_size, loaded.config.vocab_size),
                eos_token=sorted(loaded.stop_token_ids))
        return loaded.grammar_vocab


def load_model_head(path: str, weights: str, dtype="float32", device: str = "cpu") -> LoadedModel:
    """What a process that never runs the model needs of it: config, tokenizer, chat template, stop ids
    and metadata, read without the weights (``model`` is None). ``weights`` names the format the model
    was built in elsewhere (an engine worker process)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"model not found: {path}")
    if os.path.isdir(path):
        raw = _config_json(path)
        config = hf_config(raw)
        tokenizer, template, stop = hf_text_side(path, raw)
        info = hf_info(path, raw, config, weights)
        pooling = pooling_from_dir(path)
    else:
        meta, _ = open_gguf(path)
        config = gguf_config(meta)
        tokenizer, template, stop = gguf_text_side(meta)
        info = gguf_info(meta, config, weights)
        pooling = pooling_from_gguf(meta)
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {dtype!r} (choose from {', '.join(DTYPE_NAMES)})")
    fit_context(config, pooling)
    return LoadedModel(path, config, None, tokenizer, template, stop, dtype, device, info, weights, pooling=pooling)


def hf_config(raw: dict):
    """A decoder's ModelConfig or an encoder's EncoderConfig, from config.json."""
    return encoder_config_from_hf(raw) if is_encoder_hf(raw) else config_from_hf(raw)


def gguf_config(meta: dict):
    return encoder_config_from_gguf(meta) if is_encoder_gguf(meta) else config_from_gguf(meta)


def fit_context(config, pooling: Pooling) -> None:
    """An encoder reads at most sentence-transformers' max_seq_length tokens, as sentence-transformers does."""
    if getattr(config, "is_encoder", False) and pooling.max_seq_length:
        config.context_length = min(config.context_length, pooling.max_seq_length)


def model_kind(config, pooling: Pooling) -> str:
    if getattr(config, "is_encoder", False):
        return config.kind
    if pooling.mode == RANK:
        return "rerank"
    return "embedding" if pooling.declared else "chat"


def matrix_types(tensors) -> set[str]:
    """GGUF type names of the layers' matrices: what ``auto`` weights are chosen from. The embedding and
    output matrices are left out: they are int8 under int4 weights too (weight_format.target_of), so a
    Q4 file with a Q8_0 or Q6_K embedding is still a 4-bit file."""
    return {t.tensor_type.name for t in tensors if len(t.shape) == 2 and t.name not in _OUTPUT_TENSORS}


def gguf_info(meta: dict, config: ModelConfig, weights: str | None = None) -> dict:
    return {
        "weights": weights,
        "format": "gguf",
        "family": config.arch,
        "parameter_size": meta.get("general.size_label"),
        "quantization_level": _file_type_name(meta.get("general.file_type")),
        "license": meta.get("general.license"),
        "name": meta.get("general.name"),
    }


def hf_info(path: str, raw: dict, config: ModelConfig, weights: str | None = None) -> dict:
    return {"weights": weights, "format": "safetensors", "family": config.arch, "parameter_size": None,
            "quantization_level": str(raw.get("torch_dtype", "float32")).upper(), "name": os.path.basename(path)}


def read_model_info(path: str) -> tuple[ModelConfig, str | None, dict]:
    """(config, chat template, info) without reading weights: for listings and ``show``."""
    if os.path.isdir(path):
        raw = _config_json(path)
        config = hf_config(raw)
        template = (read_json(path, "tokenizer_config.json") or {}).get("chat_template")
        if template is None:
            template = read_text(path, "chat_template.jinja")
        pooling = pooling_from_dir(path)
        fit_context(config, pooling)
        return config, template, {**hf_info(path, raw, config), "kind": model_kind(config, pooling)}
    meta, tensors = open_gguf(path)
    config = gguf_config(meta)
    pooling = pooling_from_gguf(meta)
    info = {**gguf_info(meta, config), "kind": model_kind(config, pooling)}
    info["source_types"] = matrix_types(tensors)
    return config, meta.get("tokenizer.chat_template"), info


def stop_ids(tokenizer: Tokenizer, extra_ids=()) -> set:
    """The given ids, the EOS, and every turn-end marker the vocabulary holds as a whole token: a
    special one, or an added (user-defined) one as Gemma's ``<end_of_turn>`` is in its GGUF files.
    In gpt-oss's vocabulary ``<|end|>`` is not one, even when named (it ends the thinking)."""
    ids = {i for i in extra_ids if i is not None}
    whole = tokenizer.special_ids | set(tokenizer.hf.get_added_tokens_decoder())
    turn_ends = _TURN_END_TOKENS
    if tokenizer.token_to_id("<|channel|>") is not None and tokenizer.token_to_id("<|return|>") is not None:
        ids.discard(tokenizer.token_to_id("<|end|>"))
        turn_ends = tuple(t for t in _TURN_END_TOKENS if t != "<|end|>") + _HARMONY_TURN_ENDS
    for token in (tokenizer.eos_token, *turn_ends):
        if token is not None and tokenizer.token_to_id(token) is not None and (
            token == tokenizer.eos_token or tokenizer.token_to_id(token) in whole
        ):
            ids.add(tokenizer.token_to_id(token))
    return ids


def gguf_text_side(meta: dict):
    """A GGUF's tokenizer, chat template and stop ids, from its metadata."""
    tokenizer = tokenizer_from_gguf(meta)
    stop = stop_ids(tokenizer, [meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")])
    return tokenizer, meta.get("tokenizer.chat_template"), stop


def hf_text_side(path: str, raw: dict):
    """A Hugging Face folder's tokenizer, chat template and stop ids."""
    # Encoders and sentence-transformers embedding models read inputs as their tokenizer frames them.
    framed = is_encoder_hf(raw) or os.path.isfile(os.path.join(path, "modules.json"))
    tokenizer, tok_cfg = tokenizer_from_dir(path, encoder=framed)
    template = tok_cfg.get("chat_template")
    if template is None:
        template = read_text(path, "chat_template.jinja")
    stop = stop_ids(tokenizer, _ids(raw.get("eos_token_id")) + _ids(_generation_config(path).get("eos_token_id")))
    return tokenizer, template, stop


def _config_json(path: str) -> dict:
    """A folder's config.json (read as model_files reads every file of a folder: no link out, regular)."""
    raw = read_json(path, "config.json")
    if raw is None:
        raise FileNotFoundError(f"{os.path.basename(path)}: no config.json")
    return raw


def _ids(value) -> list:
    return value if isinstance(value, list) else [value]


def _generation_config(path: str) -> dict:
    """generation_config.json: where chat models (Phi-3, Llama 3) list their turn-end ids too."""
    return read_json(path, "generation_config.json", {})


def _file_type_name(file_type) -> str | None:
    if file_type is None:
        return None
    try:
        return FILE_TYPE_NAMES.get(int(file_type), str(file_type))
    except (TypeError, ValueError):
        return str(file_type)
