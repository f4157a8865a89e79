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

``auto``: a quantized source stays quantized on every device, since a quantized kernel runs
everywhere (on the CPU the C++ block kernel, or torch's weight-only kernels where it cannot be built):
int4 for a 4-bit source (every quantized tensor Q4_* or IQ4_*), which keeps its blocks as they are,
int8 for other quantized sources. A dense source is float32 on the CPU and bfloat16 on CUDA. Dense
float32 for a quantized file is the user's choice (``weights: float32``), never a measurement's:
one disturbed timing once served a 4-bit file dense, at a third of the speed and six times the
memory (docs/benchmarks.md).

Torch-free and measurement-free: the daemon's supervisor plans memory with the same
``resolve_weights`` the worker loads with; ``models/quantized.quantize`` converts the tensors.
"""

INT4_GROUP_SIZE = 32  # GGUF's block: Q4_0/Q4_1 convert exactly at this size
WEIGHT_FORMATS = ("auto", "int8", "int4", "bfloat16", "float16", "float32")
_DENSE_GGUF_TYPES = {"F32", "F16", "BF16"}
_OUTPUT_MATRICES = ("lm_head.weight", "model.embed_tokens.weight")


def resolve_weights(setting: str, device: str, source_types: set[str]) -> str:
    """The concrete format for a model whose linear weights are stored as ``source_types`` (GGUF type
    names, or torch dtype names for safetensors). Nothing is measured: the supervisor's plan and the
    worker's load agree by construction."""
    if setting not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weights format {setting!r} (choose from {', '.join(WEIGHT_FORMATS)})")
    if setting != "auto":
        return setting
    quantized_types = source_types - _DENSE_GGUF_TYPES - {"float32", "bfloat16", "float16"}
    if quantized_types and all(t.startswith(("Q4", "IQ4")) for t in quantized_types):
        return "int4"
    if quantized_types:
        return "int8"
    return "bfloat16" if device.startswith("cuda") else "float32"


def target_of(name: str, weights: str) -> str | None:
    """What the tensor ``name`` (Hugging Face naming) becomes: "int8", "int4", or None (dense)."""
    if weights not in ("int8", "int4"):
        return None
    if name in _OUTPUT_MATRICES:
        return "int8"
    if name.endswith("_proj.weight"):
        return weights
    return None
