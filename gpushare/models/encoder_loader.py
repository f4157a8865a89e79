"""load_encoder: a BERT-family encoder from a Hugging Face folder or a GGUF (llama.cpp's ``bert`` and
``nomic-bert`` layouts) -> an EncoderModel on the device, with its head (tokenizer, pooling).

Encoders keep dense weights: int8 / int4 / auto serve them in the activation dtype (they are small,
and their speed is in the batch, not in reading weights), and ``info["weights"]`` says so.
"""

import glob
import json
import os

import torch

from gpushare.catalog.encoder_config import encoder_config_from_gguf, encoder_config_from_hf
from gpushare.catalog.gguf_reader import GGUFError, open_gguf
from gpushare.catalog.model_head import LoadedModel, fit_context, gguf_info, gguf_text_side, hf_info, hf_text_side
from gpushare.catalog.pooling import pooling_from_dir, pooling_from_gguf
from gpushare.models.bert import EncoderModel, hf_encoder_name
from gpushare.models.gguf_file import _dense
from gpushare.models.llama import weight_bytes

_DENSE_FORMATS = ("float32", "bfloat16", "float16")


def _weights_name(weights: str, dtype: torch.dtype) -> str:
    return weights if weights in _DENSE_FORMATS else str(dtype).removeprefix("torch.")


def _hf_state(path: str, progress) -> dict:
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    total, done, state = sum(os.path.getsize(f) for f in files), 0, {}
    for f in files:
        try:
            with safe_open(f, "pt") as tensors:
                for hf_name in tensors.keys():
                    name = hf_encoder_name(hf_name)
                    if name is not None:
                        state[name] = tensors.get_tensor(hf_name).float()
        except Exception as e:
            raise ValueError(f"{f}: corrupt safetensors file ({e})") from e
        done += os.path.getsize(f)
        if progress is not None:
            progress(done, total)
    return state


def _gguf_state(path: str, tensors, progress) -> dict:
    total, done, state = sum(int(t.n_bytes) for t in tensors), 0, {}
    for tensor in tensors:
        shape = [int(d) for d in reversed(tensor.shape)]  # ggml lists dims fastest-first
        try:
            state[tensor.name] = _dense(tensor.data, tensor.tensor_type.name, shape)
        except Exception as e:
            raise GGUFError(f"{path}: cannot read tensor {tensor.name} ({tensor.tensor_type.name}): {e}") from e
        done += int(tensor.n_bytes)
        if progress is not None:
            progress(done, total)
    return state


def load_encoder(path: str, dtype: torch.dtype, device: str, progress=None, weights: str = "auto") -> LoadedModel:
    if os.path.isdir(path):
        raw = json.load(open(os.path.join(path, "config.json")))
        config = encoder_config_from_hf(raw)
        state = _hf_state(path, progress)
        tokenizer, template, stop = hf_text_side(path, raw)
        pooling = pooling_from_dir(path)
        info = hf_info(path, raw, config, _weights_name(weights, dtype))
    else:
        meta, tensors = open_gguf(path)
        config = encoder_config_from_gguf(meta)
        state = _gguf_state(path, tensors, progress)
        tokenizer, template, stop = gguf_text_side(meta)
        pooling = pooling_from_gguf(meta)
        info = gguf_info(meta, config, _weights_name(weights, dtype))
    if weights in _DENSE_FORMATS:
        dtype = getattr(torch, weights)
    fit_context(config, pooling)
    try:
        model = EncoderModel(config, state, dtype, device)
    except KeyError as e:
        raise ValueError(f"{path}: the {config.arch} encoder lacks tensor {e.args[0]}") from None
    with torch.inference_mode():  # torch's one-time set-up of these kernels (~35 ms on 2 cores, more beside a
        model([[0, 0]])           # running engine) is paid here, not by the first batch beside a chat stream
    return LoadedModel(path, config, model.eval(), tokenizer, template, stop, dtype, device, info, info["weights"],
                       kernel="torch", weight_bytes=weight_bytes(model), pooling=pooling)  # torch's linears
