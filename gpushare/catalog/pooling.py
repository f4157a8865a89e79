"""How a model turns its last hidden states into one vector, as its files declare it: the
sentence-transformers modules (``modules.json``, ``1_Pooling/config.json`` in the old per-mode keys or
the newer ``pooling_mode``, ``Normalize``, the ``max_seq_length`` inputs are cut to) or GGUF's
``{arch}.pooling_type``. Torch-free (the supervisor reads it); ``pool`` in models/encoder_pool.py applies it.

Where nothing is declared: mean pooling, L2-normalised (what Ollama returns for any model).
A module that would change the vector further (Dense, LayerNorm, ...) is refused, never skipped.
"""

import json
import os
from dataclasses import dataclass

from gpushare.catalog.model_config import is_yes_no_reranker

POOLING_MODES = ("mean", "cls", "last")
RANK = "rank"  # not a vector: a reranker's relevance score (models/llm_rerank.py for decoders)
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}  # llama.cpp's enum llama_pooling_type; 4 (rank) is a reranker
_OLD_KEYS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last"}
_IGNORED_MODULES = ("Transformer",)  # the model itself


@dataclass(frozen=True)
class Pooling:
    mode: str = "mean"
    normalize: bool = True
    max_seq_length: int | None = None  # sentence-transformers truncates inputs to this
    declared: bool = False  # from the model's own files (an embedding model), not the default


def pooling_from_dir(path: str) -> Pooling:
    from gpushare.catalog.llm_rerank import is_llm_reranker_dir

    if is_llm_reranker_dir(path):
        return Pooling(RANK, False, declared=True)
    modules_file = os.path.join(path, "modules.json")
    if not os.path.isfile(modules_file):
        return Pooling()
    mode, normalize = "mean", False
    for module in json.load(open(modules_file)):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Pooling":
            mode = _pooling_mode(os.path.join(path, module.get("path", ""), "config.json"))
        elif kind == "Normalize":
            normalize = True
        elif kind not in _IGNORED_MODULES:
            raise ValueError(f"{path}: sentence-transformers module {module.get('type')!r} is not supported "
                             "(supported: Transformer, Pooling, Normalize)")
    return Pooling(mode, normalize, _max_seq_length(path), declared=True)


def _pooling_mode(config_file: str) -> str:
    config = json.load(open(config_file)) if os.path.isfile(config_file) else {}
    if "pooling_mode" in config:
        modes = [config["pooling_mode"]] if isinstance(config["pooling_mode"], str) else list(config["pooling_mode"])
        modes = ["last" if m == "lasttoken" else m for m in modes]
    else:
        modes = [mode for key, mode in _OLD_KEYS.items() if config.get(key)]
        modes += [key for key in ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                                  "pooling_mode_weightedmean_tokens") if config.get(key)]
    if len(modes) != 1 or modes[0] not in POOLING_MODES:
        raise ValueError(f"{config_file}: pooling {modes} is not supported (one of: {', '.join(POOLING_MODES)})")
    if config.get("include_prompt", True) is False:
        raise ValueError(f"{config_file}: include_prompt false is not supported")
    return modes[0]


def _max_seq_length(path: str) -> int | None:
    """sentence_bert_config.json's max_seq_length, else (sentence-transformers 6 keeps it there) the
    tokenizer's model_max_length; None when neither bounds it."""
    for name, key in (("sentence_bert_config.json", "max_seq_length"), ("tokenizer_config.json", "model_max_length")):
        file = os.path.join(path, name)
        value = json.load(open(file)).get(key) if os.path.isfile(file) else None
        if isinstance(value, int) and 0 < value < 1 << 30:  # transformers writes 1e30 for "no limit"
            return value
    return None


def pooling_from_gguf(meta: dict) -> Pooling:
    value = meta.get(f"{meta.get('general.architecture')}.pooling_type")
    if value is None or int(value) == 0:  # none (per-token vectors): pool the default way
        return Pooling()
    if int(value) == 4:
        if meta.get("general.architecture") not in ("bert", "nomic-bert") and not is_yes_no_reranker(meta):
            raise ValueError("a decoder GGUF with pooling_type 4 (rank) is an LLM reranker only with "
                             f"{meta.get('general.architecture')}.classifier.output_labels [\"yes\", \"no\"] "
                             "(as llama.cpp converts Qwen3-Reranker)")
        return Pooling(RANK, False, declared=True)
    if int(value) not in _GGUF_POOLING:
        raise ValueError(f"GGUF pooling_type {value} is not supported (1 mean, 2 cls, 3 last, 4 rank)")
    return Pooling(_GGUF_POOLING[int(value)], True, declared=True)
