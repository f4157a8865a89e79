"""Crafted GGUF files: the reader refuses what would make it allocate far more than the file holds
(wrapped tensor sizes, endless metadata arrays, absurd architecture numbers) with a clear error.
The files are written byte by byte as the GGUF format lays them out."""

import struct

import pytest

from gpushare.catalog.model_config import config_from_gguf
from gpushare.catalog.gguf_reader import GGUFError, open_gguf
from gpushare.catalog.gguf_reader import read_gguf_file

STRING, ARRAY, UINT32 = 8, 9, 4
F32 = 0


def gguf_string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def gguf_file(fields: list[bytes], tensors: list[tuple[str, list[int], int, int]], data: bytes = b"") -> bytes:
    """A GGUF v3 file: ``fields`` are encoded key/value pairs, ``tensors`` (name, shape, type, offset)."""
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(fields)) + b"".join(fields)
    for name, shape, qtype, offset in tensors:
        out += gguf_string(name) + struct.pack("<I", len(shape)) + struct.pack(f"<{len(shape)}Q", *shape)
        out += struct.pack("<IQ", qtype, offset)
    out += b"\0" * (-len(out) % 32)
    return out + data


def string_array(key: str, items: list[str], claimed: int | None = None) -> bytes:
    count = len(items) if claimed is None else claimed
    return gguf_string(key) + struct.pack("<IIQ", ARRAY, STRING, count) + b"".join(gguf_string(s) for s in items)


def test_a_wrapped_tensor_size_is_refused(tmp_path):
    path = tmp_path / "wrapped.gguf"
    # 2**32 x 2**32 float32 elements: 2**66 bytes, which a 64-bit product wraps round to 0.
    path.write_bytes(gguf_file([], [("token_embd.weight", [1 << 32, 1 << 32], F32, 0)], b"\0" * 64))
    with pytest.raises(GGUFError, match="runs past the end of the file"):
        open_gguf(str(path))


def test_a_tensor_with_too_many_dimensions_is_refused(tmp_path):
    path = tmp_path / "dims.gguf"
    path.write_bytes(gguf_file([], [("t", [1] * 9, F32, 0)], b"\0" * 64))
    with pytest.raises(GGUFError, match="9 dimensions"):
        open_gguf(str(path))


def test_metadata_arrays_are_capped(tmp_path):
    path = tmp_path / "many.gguf"
    path.write_bytes(gguf_file([string_array("tokenizer.ggml.tokens", [""] * 101)], []))
    assert len(read_gguf_file(str(path), max_values=200)[0]["tokenizer.ggml.tokens"]) == 101
    with pytest.raises(ValueError, match="more values than a model's header can"):
        read_gguf_file(str(path), max_values=100)
    claims = tmp_path / "claims.gguf"
    claims.write_bytes(gguf_file([string_array("tokenizer.ggml.tokens", ["a"], claimed=1 << 40)], []))
    with pytest.raises(GGUFError, match="claims 1099511627776 items, more than the file holds"):
        open_gguf(str(claims))


@pytest.mark.parametrize("key, value, message", [
    ("context_length", 1 << 40, "context_length 1099511627776 is out of range"),
    ("block_count", 10 ** 9, "num_layers 1000000000 is out of range"),
    ("attention.head_count_kv", 0, "num_kv_heads 0 is out of range"),
])
def test_architecture_numbers_are_bounded(smollm2_path, key, value, message):
    meta, _ = open_gguf(smollm2_path)
    assert config_from_gguf(meta).context_length == 8192
    with pytest.raises(ValueError, match=message):
        config_from_gguf({**meta, f"llama.{key}": value})
