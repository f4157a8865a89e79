"""load_model: a GGUF file or a Hugging Face folder -> weights on the device, tokenizer, chat template."""

import ctypes
import glob
import json
import os
from dataclasses import dataclass, field

import torch

from gpushare.models import chat_template
from gpushare.models.config import ModelConfig, config_from_gguf, config_from_hf
from gpushare.models.hf_names import hf_tensor, text_model_name
from gpushare.models.gguf_file import open_gguf, read_tensors
from gpushare.models.llama import LlamaModel, build_model, weight_bytes
from gpushare.models.tokenizer import Tokenizer, tokenizer_from_dir, tokenizer_from_gguf
from gpushare.models.tensor_parallel import rank_config, shard_state, split_model
from gpushare.models.weight_format import DENSE_FORMATS, quantize, resolve_weights, target_of

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Chat models end a turn with one of these even when the metadata names another EOS.
_TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "</s>", "<end_of_turn>",
                    "<|end|>")


@dataclass
class LoadedModel:
    name_or_path: str
    config: ModelConfig
    model: LlamaModel
    tokenizer: Tokenizer
    template_source: str | None
    stop_token_ids: set
    dtype: torch.dtype
    device: str
    metadata: dict = field(default_factory=dict)
    weights: str = "float32"  # the weight format it was built in (gpushare.models.weight_format)
    _template: object = None
    grammar_vocab: object = None  # llguidance's view of the tokenizer, built on first constrained request
    whole_config: ModelConfig | None = None  # tensor parallel: the whole model's (``config`` is this rank's)

    @property
    def weight_bytes(self) -> int:
        return weight_bytes(self.model)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        if self._template is None:
            self._template = chat_template.compile_template(self.template_source)
        return chat_template.render(self._template, messages, self.tokenizer.bos_token, self.tokenizer.eos_token,
                                    add_generation_prompt=add_generation_prompt, **extra)


def resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    return DTYPES[dtype]


def _stop_ids(tokenizer: Tokenizer, extra_ids=()) -> set:
    """The given ids, the EOS, and every turn-end marker the vocabulary holds as a whole token: a
    special one, or an added (user-defined) one as Gemma's ``<end_of_turn>`` is in its GGUF files."""
    ids = {i for i in extra_ids if i is not None}
    whole = tokenizer.special_ids | set(tokenizer.hf.get_added_tokens_decoder())
    for token in (tokenizer.eos_token, *_TURN_END_TOKENS):
        if token is not None and tokenizer.token_to_id(token) is not None and (
            token == tokenizer.eos_token or tokenizer.token_to_id(token) in whole
        ):
            ids.add(tokenizer.token_to_id(token))
    return ids


def read_gguf(path: str, progress=None, weights: str = "float32", device: str = "cpu"):
    """Parse a GGUF into (config, state dict, tokenizer, template, stop ids, info): float32 tensors, or
    for ``weights`` int8/int4/auto the linear weights quantized as they are read; ``info["weights"]``
    names the format."""
    meta, tensors = open_gguf(path)
    config = config_from_gguf(meta)
    weights = resolve_weights(weights, device, _matrix_types(tensors))
    state = read_tensors(tensors, path, config.num_heads, config.num_kv_heads, permuted_qk=config.arch == "llama",
                         progress=progress, weights=weights, gate_up_fused=config.arch == "phi3")
    for which in ("short", "long"):  # LongRoPE's factors travel as tensors in GGUF
        factors = state.pop(f"rope_factors_{which}", None)
        if factors is not None:
            config.rope_scaling[f"{which}_factor"] = factors.flatten().tolist()
    config.tie_word_embeddings = "lm_head.weight" not in state
    tokenizer = tokenizer_from_gguf(meta)
    stop = _stop_ids(tokenizer, [meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")])
    return config, state, tokenizer, meta.get("tokenizer.chat_template"), stop, _gguf_info(meta, config, weights)


def _matrix_types(tensors) -> set[str]:
    """GGUF type names of the file's matrices: what ``auto`` weights are chosen from."""
    return {t.tensor_type.name for t in tensors if len(t.shape) == 2}


def _gguf_info(meta: dict, config: ModelConfig, weights: str | None = None) -> dict:
    return {
        "weights": weights,
        "format": "gguf",
        "family": config.arch,
        "parameter_size": meta.get("general.size_label"),
        "quantization_level": _file_type_name(meta.get("general.file_type")),
        "license": meta.get("general.license"),
        "name": meta.get("general.name"),
    }


def _hf_info(path: str, raw: dict, config: ModelConfig, weights: str | None = None) -> dict:
    return {"weights": weights, "format": "safetensors", "family": config.arch, "parameter_size": None,
            "quantization_level": str(raw.get("torch_dtype", "float32")).upper(), "name": os.path.basename(path)}


def read_model_info(path: str) -> tuple[ModelConfig, str | None, dict]:
    """(config, chat template, info) without reading weights: for listings and ``show``."""
    if os.path.isdir(path):
        cfg_file = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_file):
            raise FileNotFoundError(f"{path}: no config.json")
        raw = json.load(open(cfg_file))
        config = config_from_hf(raw)
        tok_cfg = os.path.join(path, "tokenizer_config.json")
        template = json.load(open(tok_cfg)).get("chat_template") if os.path.isfile(tok_cfg) else None
        return config, template, _hf_info(path, raw, config)
    meta, tensors = open_gguf(path)
    config = config_from_gguf(meta)
    info = _gguf_info(meta, config)
    info["source_types"] = _matrix_types(tensors)
    return config, meta.get("tokenizer.chat_template"), info


def read_hf_dir(path: str, progress=None, weights: str = "float32", device: str = "cpu"):
    """Parse a Hugging Face folder: config.json, *.safetensors (sharded too), tokenizer files; tensors
    as ``read_gguf`` gives them, each converted as soon as it is read."""
    from safetensors import safe_open

    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"{path}: no config.json")
    raw = json.load(open(cfg_file))
    config = config_from_hf(raw)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    weights = resolve_weights(weights, device, set())  # safetensors folders hold dense weights
    state = {}
    total = sum(os.path.getsize(f) for f in files)
    done = 0
    for f in files:
        try:
            with safe_open(f, "pt") as tensors:
                for hf_name in tensors.keys():
                    name = text_model_name(hf_name)
                    if name is None:
                        continue
                    name, dense = hf_tensor(name, tensors.get_tensor(hf_name).float(), config)
                    target = target_of(name, weights)
                    state[name] = dense if target is None else quantize(name, dense, target)
        except Exception as e:
            raise ValueError(f"{f}: corrupt safetensors file ({e})") from e
        done += os.path.getsize(f)
        if progress is not None:
            progress(done, total)
    tokenizer, template, stop = _hf_text_side(path, raw)
    return config, state, tokenizer, template, stop, _hf_info(path, raw, config, weights)


def _hf_text_side(path: str, raw: dict):
    """A Hugging Face folder's tokenizer, chat template and stop ids."""
    tokenizer, tok_cfg = tokenizer_from_dir(path)
    template = tok_cfg.get("chat_template")
    template_file = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.isfile(template_file):
        template = open(template_file).read()
    stop = _stop_ids(tokenizer, _ids(raw.get("eos_token_id")) + _ids(_generation_config(path).get("eos_token_id")))
    return tokenizer, template, stop


def _ids(value) -> list:
    return value if isinstance(value, list) else [value]


def _generation_config(path: str) -> dict:
    """generation_config.json: where chat models (Phi-3, Llama 3) list their turn-end ids too."""
    file = os.path.join(path, "generation_config.json")
    return json.load(open(file)) if os.path.isfile(file) else {}


def load_model(path: str, dtype="float32", device: str = "cpu", progress=None, weights: str = "auto",
               tensor_parallel: tuple[int, int] | None = None) -> LoadedModel:
    """Load a model for serving; raises FileNotFoundError / ValueError naming the problem.

    ``dtype``: activations and KV cache; ``weights``: the weight format (weight_format.WEIGHT_FORMATS).
    ``progress(done_bytes, total_bytes)`` reports reading and converting (the slow part).
    ``tensor_parallel``: (rank, world size): build only that rank's part (models/tensor_parallel.py);
    its ``config`` then has the rank's heads and MLP channels. The whole file is read first.
    """
    torch_dtype = resolve_dtype(dtype)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model not found: {path}")
    reader = read_hf_dir if os.path.isdir(path) else read_gguf
    config, state, tokenizer, template, stop, info = reader(path, progress, weights, device)
    whole_config = config
    if tensor_parallel is not None:
        rank, world_size = tensor_parallel
        part = split_model(config, world_size, path)[rank]
        state = shard_state(state, config, part)
        config = rank_config(config, part)
    model = build_model(config, state, torch_dtype, device, DENSE_FORMATS.get(info["weights"]))
    del state
    return_freed_memory()
    return LoadedModel(path, config, model, tokenizer, template, stop, torch_dtype, device, info, info["weights"],
                       whole_config=whole_config if tensor_parallel is not None else None)


def load_model_head(path: str, weights: str, dtype="float32", device: str = "cpu") -> LoadedModel:
    """What a process that never runs the model needs of it: config, tokenizer, chat template, stop ids
    and metadata, read without the weights (``model`` is None). ``weights`` names the format the model
    was built in elsewhere (an engine worker process)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"model not found: {path}")
    if os.path.isdir(path):
        raw = json.load(open(os.path.join(path, "config.json")))
        config = config_from_hf(raw)
        tokenizer, template, stop = _hf_text_side(path, raw)
        info = _hf_info(path, raw, config, weights)
    else:
        meta, _ = open_gguf(path)
        config = config_from_gguf(meta)
        tokenizer = tokenizer_from_gguf(meta)
        template = meta.get("tokenizer.chat_template")
        stop = _stop_ids(tokenizer, [meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")])
        info = _gguf_info(meta, config, weights)
    return LoadedModel(path, config, None, tokenizer, template, stop, resolve_dtype(dtype), device, info, weights)


def return_freed_memory() -> None:
    """Give the OS back the heap that conversion copies left free: glibc keeps it otherwise (a
    SmolLM2 int8 load holds ~260 MiB more RSS without this). Other C libraries: nothing to do."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _file_type_name(file_type) -> str | None:
    if file_type is None:
        return None
    try:
        from gguf import LlamaFileType

        return LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_")
    except ValueError:
        return str(file_type)
