"""load_model: a GGUF file or a Hugging Face folder -> weights on the device, with its head (tokenizer,
chat template, stop ids: catalog/model_head.py). Encoders (BERT family) load through models/encoder_loader.py."""

import ctypes
import dataclasses
import os

import torch

from gpushare import kernels
from gpushare.catalog.model_files import read_json, weight_files
from gpushare.catalog.model_config import config_from_gguf, config_from_hf
from gpushare.models.cpu_kernels import measure_again_if_provisional, quantized_kernel, wide_int8_kernel
from gpushare.catalog.encoder_config import is_encoder_gguf, is_encoder_hf
from gpushare.catalog.pooling import pooling_from_dir, pooling_from_gguf
from gpushare.models.encoder_loader import load_encoder
from gpushare.models.gguf_file import read_tensors
from gpushare.catalog.gguf_reader import open_gguf
from gpushare.models.hf_names import hf_tensor, text_model_name
from gpushare.models.linear import Linear
from gpushare.models.llama import build_model, weight_bytes
from gpushare.catalog.model_head import (DTYPE_NAMES, LoadedModel, gguf_info, gguf_text_side, hf_info, hf_text_side,
                                        matrix_types)
from gpushare.models.quantized import quantize
from gpushare.models.tp_weights import shard_state
from gpushare.catalog.tensor_split import rank_config, split_model
from gpushare.protocol.weight_format import resolve_weights, target_of

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    return DTYPES[dtype]


def device_placer(device: str, dtype: torch.dtype | None, weights: str):
    """read_tensors' ``place`` for a load onto ``device``: each tensor moves there as soon as it is
    read, so the host never holds the model (a 70B model at 4 bits would be ~40 GB of RAM). Dense
    matrices go over in the weight format's dtype, other dense tensors in ``dtype`` (the model casts
    them to it anyway), so the device holds no float32 copy either. None (tensors stay where they
    are read) on the CPU, or without ``dtype`` (a tensor-parallel load splits the host copy first)."""
    if device == "cpu" or dtype is None:
        return None
    matrix_dtype = DTYPES.get(weights, dtype)  # int8/int4: their dense matrices (the embedding) in dtype

    def move(tensor: torch.Tensor, cast: torch.dtype | None = None) -> torch.Tensor:
        return tensor.to(device, dtype=cast if cast is not None and tensor.is_floating_point() else None)

    def place(name: str, value):
        if not isinstance(value, torch.Tensor):  # a quantized weight: its codes and scales as they are
            return dataclasses.replace(value, **{f.name: move(getattr(value, f.name)) for f in dataclasses.fields(value)
                                                 if isinstance(getattr(value, f.name), torch.Tensor)})
        if name.startswith("rope_"):  # a few numbers the rope table is computed from on the host
            return value
        return move(value, matrix_dtype if value.dim() == 2 else dtype)

    return place


def read_gguf(path: str, progress=None, weights: str = "float32", device: str = "cpu", header=None, dtype=None):
    """Parse a GGUF into (config, state dict, tokenizer, template, stop ids, info): float32 tensors, or
    for ``weights`` int8/int4/auto the linear weights quantized as they are read; ``info["weights"]``
    names the format. ``header``: open_gguf's (metadata, tensors) of ``path``, where the caller has it.
    ``dtype`` (the model's activations): tensors go to ``device`` as they are read (device_placer)."""
    meta, tensors = header or open_gguf(path)
    config = config_from_gguf(meta)
    weights = resolve_weights(weights, device, matrix_types(tensors))
    state = read_tensors(tensors, path, config.num_heads, config.num_kv_heads, permuted_qk=config.arch == "llama",
                         progress=progress, weights=weights, gate_up_fused=config.arch == "phi3",
                         place=device_placer(device, dtype, weights))
    for which in ("short", "long"):  # LongRoPE's factors travel as tensors in GGUF
        factors = state.pop(f"rope_factors_{which}", None)
        if factors is not None:
            config.rope_scaling[f"{which}_factor"] = factors.flatten().tolist()
    config.tie_word_embeddings = "lm_head.weight" not in state
    tokenizer, template, stop = gguf_text_side(meta)
    return config, state, tokenizer, template, stop, gguf_info(meta, config, weights)


def read_hf_dir(path: str, progress=None, weights: str = "float32", device: str = "cpu", dtype=None):
    """Parse a Hugging Face folder: config.json, *.safetensors (sharded too), tokenizer files; tensors
    as ``read_gguf`` gives them (placed as it does), each converted as soon as it is read."""
    from safetensors import safe_open

    raw = read_json(path, "config.json")
    if raw is None:
        raise FileNotFoundError(f"{os.path.basename(path)}: no config.json")
    config = config_from_hf(raw)
    files = weight_files(path)
    if not files:
        raise FileNotFoundError(f"{os.path.basename(path)}: no *.safetensors files")
    weights = resolve_weights(weights, device, set())  # safetensors folders hold dense weights
    place = device_placer(device, dtype, weights)
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
                    # a copy even of a float32 tensor: a view would keep the whole file's mapping, every
                    # page of it read, resident for as long as the model (a dense folder served as int4
                    # held its float32 file besides)
                    read = tensors.get_tensor(hf_name).to(torch.float32, copy=True)
                    name, dense = hf_tensor(name, read, config)
                    target = target_of(name, weights)
                    value = dense if target is None else quantize(name, dense, target)
                    del read, dense
                    state[name] = value if place is None else place(name, value)
        except Exception as e:
            raise ValueError(f"{os.path.basename(f)}: corrupt safetensors file ({e})") from e
        done += os.path.getsize(f)
        if progress is not None:
            progress(done, total)
    tokenizer, template, stop = hf_text_side(path, raw)
    return config, state, tokenizer, template, stop, hf_info(path, raw, config, weights)


def load_model(path: str, dtype="float32", device: str = "cpu", progress=None, weights: str = "auto",
               tensor_parallel: tuple[int, int] | None = None) -> LoadedModel:
    """Load a model for serving; raises FileNotFoundError / ValueError naming the problem.

    ``dtype``: activations and KV cache; ``weights``: the weight format (weight_format.WEIGHT_FORMATS).
    ``progress(done_bytes, total_bytes)`` reports reading and converting (the slow part).
    ``tensor_parallel``: (rank, world size): build only that rank's part (models/tp_weights.py);
    its ``config`` then has the rank's heads and MLP channels. The whole file is read first (into
    host memory); otherwise each tensor goes to ``device`` as it is read (device_placer).
    """
    torch_dtype = resolve_dtype(dtype)
    measure_again_if_provisional()
    if not os.path.exists(path):
        raise FileNotFoundError(f"model not found: {path}")
    # a GGUF's header once (a 49k-token vocabulary and its merges: ~0.1 s of Python a read)
    header = None if os.path.isdir(path) else open_gguf(path)
    if _is_encoder(path, header):
        if tensor_parallel is not None:
            raise ValueError(f"{path}: encoders are not split across devices (tensor parallel)")
        return load_encoder(path, torch_dtype, device, progress, weights)
    streamed = None if tensor_parallel is not None else torch_dtype
    if header is None:
        config, state, tokenizer, template, stop, info = read_hf_dir(path, progress, weights, device, streamed)
    else:
        config, state, tokenizer, template, stop, info = read_gguf(path, progress, weights, device, header, streamed)
    whole_config = config
    if tensor_parallel is not None:
        rank, world_size = tensor_parallel
        part = split_model(config, world_size, path)[rank]
        state = shard_state(state, config, part)
        config = rank_config(config, part)
    model = build_model(config, state, torch_dtype, device, DTYPES.get(info["weights"]))
    del state
    if device == "cpu":  # measured or built here, not in the first request's step
        kernels.prepare_cpu()
        if info["weights"] == "int8" and quantized_kernel() == "torch":
            wide_int8_kernel()
    return_freed_memory()
    return LoadedModel(path, config, model, tokenizer, template, stop, torch_dtype, device, info, info["weights"],
                       kernel=linear_kernels(model), weight_bytes=weight_bytes(model),
                       whole_config=whole_config if tensor_parallel is not None else None,
                       pooling=pooling_from_dir(path) if header is None else pooling_from_gguf(header[0]))


def _is_encoder(path: str, header) -> bool:
    if header is None:
        raw = read_json(path, "config.json")
        return raw is not None and is_encoder_hf(raw)
    return is_encoder_gguf(header[0])


def linear_kernels(model) -> str:
    """The kernels a built model's linears run on, most weights first ("cpu-blocks", "onednn", ...)."""
    weights_by_kernel: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, Linear):
            weights_by_kernel[module.kernel] = weights_by_kernel.get(module.kernel, 0) + module.in_features * module.out_features
    return "+".join(sorted(weights_by_kernel, key=weights_by_kernel.get, reverse=True))


def return_freed_memory() -> None:
    """Give the OS back the heap that conversion copies left free: glibc keeps it otherwise (a
    SmolLM2 int8 load holds ~260 MiB more RSS without this). Other C libraries: nothing to do."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


