"""LoRA adapters read from disk and checked against their base: a PEFT folder (adapter_config.json +
adapter_model.safetensors) or a GGUF LoRA (``general.type = adapter``, llama.cpp's converter), each
turned into per-layer, per-target float32 ``A [r, in]`` and ``B [out, r]`` with one scale (alpha / r).

Every refusal is a ValueError naming the adapter (and, for a mismatch, the base and both shapes).
Its files are read as a model's are (catalog/model_files.py: no link out of the folder, regular files
only, sizes capped), and a refusal quotes nothing a file holds but numbers and tensor or module names: an
adapter folder is written by whoever made it, and the error goes to the tenant who asked.
"""

import math
import os
import re
from dataclasses import dataclass, field

import torch

from gpushare.catalog.model_config import ModelConfig
from gpushare.catalog.model_files import ModelFileError, read_json, weight_files
from gpushare.models.gguf_file import unpermute_order
from gpushare.models.quantized import permute_rows

MIN_RANK, MAX_RANK = 1, 64  # the ranks the batched kernels (kernels/lora_*) cover
MAX_CONFIG_BYTES = 1 << 20  # adapter_config.json (peft writes ~1 KB)
MAX_WEIGHTS_BYTES = 4 << 30  # a weights file: rank 64 on every projection of a 70B base is 3.3 GB in float32
READ_TIMEOUT_S = 120.0  # reading an adapter's files (at most MAX_WEIGHTS_BYTES) on a slow disk; longer: stuck
TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
PEFT_TARGETS = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o",
                "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
GGUF_TARGETS = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o",
                "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down"}
_PEFT_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")
_GGUF_KEY = re.compile(r"blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")
_SHOWN = re.compile(r"[\w.\-]{1,80}")


def shown(name) -> str:
    """A tensor or module name read from an adapter's file as an error may quote it: a short name, else
    only that it is not shown (an error never carries what a file holds)."""
    return repr(name) if isinstance(name, str) and _SHOWN.fullmatch(name) else "(a name not shown)"


@dataclass
class LoraAdapter:
    name: str
    rank: int
    scale: float  # lora_alpha / r (sqrt(r) with rsLoRA)
    weights: dict = field(default_factory=dict)  # (layer, target) -> (A [r, in], B [out, r]): float32 as read,
    # then the dtype of the stacks of the base it is loaded on (models/lora_table.py)
    base_name: str = ""  # the base it says it was trained on (base_model_name_or_path), "" if unsaid
    rope_order: bool = False  # q and k lora_B rows in llama.cpp's GGUF RoPE order (fit_to_base undoes it)
    arch: str = ""  # the architecture it says it is for (a GGUF's general.architecture), "" if unsaid

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def target_shape(config: ModelConfig, target: str) -> tuple[int, int]:
    """``(out_features, in_features)`` of a target projection in the base."""
    q, kv, h, inter = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, \
        config.hidden_size, config.intermediate_size
    return {"q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q),
            "gate": (inter, h), "up": (inter, h), "down": (h, inter)}[target]


def check_rank(name: str, rank) -> int:
    if not isinstance(rank, int) or not MIN_RANK <= rank <= MAX_RANK:
        said = rank if isinstance(rank, int) else "(not a whole number)"
        raise ValueError(f"adapter {name!r}: rank {said} is not covered (ranks {MIN_RANK} to {MAX_RANK})")
    return rank


def fit_to_base(adapter: LoraAdapter, config: ModelConfig, base: str) -> None:
    """ValueError naming the adapter, the base, the tensor and both shapes where they do not fit; a GGUF
    adapter's q and k lora_B rows are put back in the base's row order."""
    if adapter.arch and adapter.arch != config.arch:
        raise ValueError(f"adapter {adapter.name!r} is for architecture {adapter.arch!r}, base {base!r} is "
                         f"{config.arch!r}")
    for (layer, target), (a, b) in adapter.weights.items():
        if layer >= config.num_layers:
            raise ValueError(f"adapter {adapter.name!r} has layer {layer}, base {base!r} has "
                             f"{config.num_layers} layers")
        out_features, in_features = target_shape(config, target)
        for part, got, want in (("A", a.shape, (adapter.rank, in_features)), ("B", b.shape, (out_features, adapter.rank))):
            if tuple(got) != want:
                raise ValueError(f"adapter {adapter.name!r} does not fit base {base!r}: layer {layer} {target} "
                                 f"lora_{part} is {list(got)}, the base needs {list(want)}")
    if adapter.rope_order and config.arch == "llama":
        heads = {"q": config.num_heads, "k": config.num_kv_heads}
        for (layer, target), (a, b) in list(adapter.weights.items()):
            if target in heads:
                adapter.weights[layer, target] = (a, permute_rows(b, unpermute_order(b.shape[0], heads[target])))
        adapter.rope_order = False


def _pair_up(name: str, found: dict) -> dict:
    """``{(layer, target): {"A": t, "B": t}}`` -> ``{(layer, target): (A, B)}``; both halves needed."""
    weights = {}
    for key, halves in sorted(found.items()):
        if set(halves) != {"A", "B"}:
            raise ValueError(f"adapter {name!r}: layer {key[0]} {key[1]} has lora_{''.join(halves)} only")
        weights[key] = (halves["A"].float().contiguous(), halves["B"].float().contiguous())
    if not weights:
        raise ValueError(f"adapter {name!r} holds no LoRA tensors")
    return weights


def _check_ranks(name: str, weights: dict, rank: int) -> None:
    for (layer, target), (a, b) in weights.items():
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(f"adapter {name!r}: layer {layer} {target} has lora_A {list(a.shape)} and lora_B "
                             f"{list(b.shape)}, not rank {rank}")


def _peft_config(name: str, path: str) -> dict:
    try:  # ModelFileError and JSON's errors say where, never what
        config = read_json(path, "adapter_config.json", limit_bytes=MAX_CONFIG_BYTES)
    except (OSError, ValueError) as e:
        raise ValueError(f"adapter {name!r}: adapter_config.json cannot be read: {e}") from None
    if config is None:
        raise ValueError(f"adapter {name!r}: adapter_config.json is missing")
    if not isinstance(config, dict):
        raise ValueError(f"adapter {name!r}: adapter_config.json is not an object")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter {name!r}: its peft_type is not LORA")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform"):
        if config.get(key):
            raise ValueError(f"adapter {name!r}: {key} is not supported")
    if config.get("use_dora") or config.get("fan_in_fan_out") or config.get("bias", "none") != "none":
        raise ValueError(f"adapter {name!r}: DoRA, fan_in_fan_out and LoRA biases are not supported")
    return config


def _peft_targets(name: str, config: dict) -> None:
    targets = config.get("target_modules") or []
    if isinstance(targets, str):  # a regular expression over module names: the tensors say what it meant
        return
    if not isinstance(targets, list):
        raise ValueError(f"adapter {name!r}: target_modules is not a list of module names")
    unknown = sorted(shown(t).strip("'") for t in set(map(str, targets)) - set(PEFT_TARGETS))
    if unknown:
        raise ValueError(f"adapter {name!r}: target modules {unknown} are not covered "
                         f"(covered: {', '.join(PEFT_TARGETS)})")


def read_peft(path: str, name: str) -> LoraAdapter:
    """A PEFT LoRA folder (what ``save_pretrained`` writes)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = _peft_config(name, path)
    rank = check_rank(name, config.get("r"))
    _peft_targets(name, config)
    try:
        files = weight_files(path, "adapter_model.safetensors")  # no link out, no FIFO
        if not files:
            raise ValueError("it is missing")
        checked_size(files[0], "adapter_model.safetensors")
        tensors = load_file(files[0])
    except (OSError, SafetensorError, ValueError, RuntimeError) as e:
        raise ValueError(f"adapter {name!r}: adapter_model.safetensors cannot be read: {e}") from None
    found = {}
    for key, tensor in tensors.items():
        m = _PEFT_KEY.search(key)
        if m is None or m.group(2) not in PEFT_TARGETS:
            raise ValueError(f"adapter {name!r}: tensor {shown(key)} is not a LoRA weight of a covered target "
                             f"({', '.join(PEFT_TARGETS)})")
        found.setdefault((int(m.group(1)), PEFT_TARGETS[m.group(2)]), {})[m.group(3)] = tensor
    weights = _pair_up(name, found)
    _check_ranks(name, weights, rank)
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ValueError(f"adapter {name!r}: lora_alpha is not a number")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return LoraAdapter(name, rank, float(scale), weights, str(config.get("base_model_name_or_path") or ""))


def read_gguf(path: str, name: str) -> LoraAdapter:
    """A GGUF LoRA as llama.cpp's convert_lora_to_gguf writes it. Its q and k lora_B rows are in the
    GGUF's RoPE order, as the base's q and k weights are: fit_to_base undoes it with the base's heads."""
    from gpushare.catalog.gguf_reader import open_gguf

    try:
        checked_size(path, "the GGUF file")
        fields, tensors = open_gguf(path)  # a FIFO or device is refused at open, never waited on
    except (OSError, ValueError) as e:  # GGUFError names the file and the problem
        raise ValueError(f"adapter {name!r}: the GGUF file cannot be read: {e}") from None
    if fields.get("general.type") != "adapter" or fields.get("adapter.type", "lora") != "lora":
        raise ValueError(f"adapter {name!r}: the GGUF file is not a LoRA adapter (its general.type is not "
                         f"'adapter', or its adapter.type not 'lora')")
    found = {}
    for t in tensors:
        m = _GGUF_KEY.match(t.name)
        if m is None or m.group(2) not in GGUF_TARGETS:
            raise ValueError(f"adapter {name!r}: tensor {shown(t.name)} is not a LoRA weight of a covered target "
                             f"({', '.join(GGUF_TARGETS)})")
        if t.tensor_type.name not in ("F32", "F16", "BF16"):
            raise ValueError(f"adapter {name!r}: tensor {shown(t.name)} is {t.tensor_type.name}, not F32/F16/BF16")
        shape = [int(d) for d in reversed(t.shape)]
        tensor = torch.from_numpy(t.data.astype("float32").reshape(shape))  # host: read from the file
        found.setdefault((int(m.group(1)), GGUF_TARGETS[m.group(2)]), {})[m.group(3).upper()] = tensor
    weights = _pair_up(name, found)
    rank = check_rank(name, next(iter(weights.values()))[0].shape[0])
    _check_ranks(name, weights, rank)
    alpha = float(fields.get("adapter.lora.alpha") or rank)
    return LoraAdapter(name, rank, alpha / rank, weights, str(fields.get("general.basename") or ""), rope_order=True,
                       arch=str(fields.get("general.architecture") or ""))


def checked_size(path: str, shown_as: str) -> None:
    """ModelFileError when the file at ``path`` is over MAX_WEIGHTS_BYTES (before a byte of it is read)."""
    if os.path.getsize(path) > MAX_WEIGHTS_BYTES:
        raise ModelFileError(f"{shown_as} is over {MAX_WEIGHTS_BYTES} bytes, the most an adapter's weights may hold")


def read_adapter(path: str, name: str) -> LoraAdapter:
    """The adapter at ``path`` (a PEFT folder or a GGUF file), ValueError if it is neither or is broken."""
    if os.path.isdir(path):
        return read_peft(path, name)
    if os.path.isfile(path):
        return read_gguf(path, name)
    raise ValueError(f"adapter {name!r}: {os.path.basename(path)!r} is neither a PEFT folder nor a GGUF file")
