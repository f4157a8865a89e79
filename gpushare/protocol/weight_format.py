"""The weight format of a model (``engine.weights`` / ``models[].weights``): what ``auto`` means on
each device, and what becomes of each tensor as the file is read.

- ``float32``, ``bfloat16``, ``float16``: dense linear weights in that dtype (activations keep
  ``engine.dtype``); ``float32`` weights with ``float32`` activations are the exact path the
  oracle tests compare against transformers.
- ``int8``: every linear per output channel in int8, lm_head and embedding included (one
  tied copy serves both); a GGUF's 4- or 8-bit blocks are dequantized one tensor at a time and
  requantized, so no float32 copy of the whole model ever exists.
- ``int4``: the layers' linears in 4-bit groups of 32 (GGUF Q4_0/Q4_1 blocks convert exactly);
  lm_head and embedding in int8, since the output projection is where 4 bits cost the most
  quality and int8 keeps it within noise (docs/benchmarks.md, perplexity).

``auto``: for a 4-bit source (every quantized tensor Q4_* or IQ4_*) int4, which keeps its
blocks as they are, on CUDA and on a CPU that runs the block kernel (cpu_kernels.quantized_kernel:
there int4 measured faster than int8 at every batch size, and closer to float32's perplexity);
for other quantized sources int8 (on the CPU where it measures faster than float32, float32
otherwise); for dense sources float32 on the CPU, bfloat16 on CUDA.

Torch-free: the daemon's supervisor plans memory with ``planned_weights``, which never measures
(the process that loads the model, an engine worker, resolves for real with ``resolve_weights``);
``models/quantized.quantize`` converts the tensors.
"""

from typing import Callable

from gpushare.models.cpu_kernels import (known_cpu_weights, known_quantized_kernel, quantized_cpu_weights,
                                         quantized_kernel)

INT4_GROUP_SIZE = 32  # GGUF's block: Q4_0/Q4_1 convert exactly at this size
WEIGHT_FORMATS = ("auto", "int8", "int4", "bfloat16", "float16", "float32")
_DENSE_GGUF_TYPES = {"F32", "F16", "BF16"}
_OUTPUT_MATRICES = ("lm_head.weight", "model.embed_tokens.weight")


def resolve_weights(setting: str, device: str, source_types: set[str]) -> str:
    """The concrete format for a model whose linear weights are stored as ``source_types``
    (GGUF type names, or torch dtype names for safetensors). On the CPU ``auto`` may time the
    kernels once per machine (cpu_kernels): for the process that loads."""
    return _resolve(setting, device, source_types, quantized_cpu_weights, lambda: quantized_kernel() == "blocks")


def planned_weights(setting: str, device: str, source_types: set[str]) -> str:
    """``resolve_weights`` without timing anything, for the supervisor's size estimates and listings:
    on the CPU ``auto`` takes this machine's kept verdicts where there are some, else guesses that
    int8 and the block kernel win. A wrong guess costs only the first estimate: the registry replaces
    it with the loaded model's real size, and the worker, which resolves for real, keeps the verdicts."""
    return _resolve(setting, device, source_types, lambda: known_cpu_weights() or "int8",
                    lambda: (known_quantized_kernel() or "blocks") == "blocks")


def _resolve(setting: str, device: str, source_types: set[str], cpu_quantized: Callable[[], str],
             cpu_blocks: Callable[[], bool]) -> str:
    if setting not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weights format {setting!r} (choose from {', '.join(WEIGHT_FORMATS)})")
    if setting != "auto":
        return setting
    quantized_types = source_types - _DENSE_GGUF_TYPES - {"float32", "bfloat16", "float16"}
    four_bit = bool(quantized_types) and all(t.startswith(("Q4", "IQ4")) for t in quantized_types)
    if not device.startswith("cuda"):
        if not quantized_types:
            return "float32"
        chosen = cpu_quantized()
        return "int4" if chosen == "int8" and four_bit and cpu_blocks() else chosen
    if four_bit:
        return "int4"
    return "int8" if quantized_types else "bfloat16"


def target_of(name: str, weights: str) -> str | None:
    """What the tensor ``name`` (Hugging Face naming) becomes: "int8", "int4", or None (dense)."""
    if weights not in ("int8", "int4"):
        return None
    if name in _OUTPUT_MATRICES:
        return "int8"
    if name.endswith("_proj.weight"):
        return weights
    return None
