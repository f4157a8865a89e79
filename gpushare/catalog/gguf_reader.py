"""A small GGUF parser: metadata and tensor locations, with the tensor bytes memory-mapped
(``open_gguf``: any failure a GGUFError naming the file). Neither torch nor numpy: the daemon's
supervisor reads headers with it (a tensor's ``data`` view takes numpy, in the engine workers).

gguf's own reader builds a numpy view per array element, which takes seconds on a 49k-token
vocabulary; walking the header with ``struct`` takes a few hundred milliseconds.

A crafted file must not make the reader allocate far more than the file holds: metadata values
are capped in number (a string or an empty array costs a few bytes of file but a Python object),
and tensor sizes are computed exactly and checked against the file.
"""

import mmap
import os
import struct
import sys
from array import array
from dataclasses import dataclass

from gpushare.catalog.ggml_types import BLOCK_SIZES, GGMLType
from gpushare.catalog.model_files import open_regular

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF value types -> struct format of one scalar
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
# GGUF value types -> array typecode of an array of them (GGUF is little-endian, as the hosts we run on)
_ARRAYS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "B", 10: "Q", 11: "q", 12: "d"}
_BOOL = 7
_STRING, _ARRAY = 8, 9
MAX_METADATA_VALUES = 1 << 24  # 16M: large vocabularies (256k tokens, scores, types, 500k merges) fit many times
MAX_TENSOR_DIMS = 4  # GGML_MAX_DIMS


@dataclass
class TensorInfo:
    name: str
    shape: list[int]  # ggml order: fastest-varying dimension first
    tensor_type: GGMLType
    offset: int  # from the start of the file
    n_bytes: int
    mm: mmap.mmap  # the whole file, read-only

    @property
    def data(self):
        """The raw tensor as gguf's reader gives it (a numpy array over the mapped file): floats in
        numpy shape, or [rows, row bytes] uint8 blocks."""
        import numpy as np  # the engine workers', not the supervisor's

        raw = np.frombuffer(self.mm, np.uint8, self.n_bytes, self.offset)
        rows = [int(d) for d in reversed(self.shape)]
        if self.tensor_type == GGMLType.F32:
            return raw.view(np.float32).reshape(rows)
        if self.tensor_type == GGMLType.F16:
            return raw.view(np.float16).reshape(rows)
        return raw.reshape(rows[:-1] + [-1])


_LENGTH = struct.Struct("<Q")  # a string's byte count


class _Cursor:
    def __init__(self, buf, max_values: int):
        self.buf, self.pos = buf, 0
        self.values_left = max_values

    def _count(self, n: int) -> None:
        self.values_left -= n
        if self.values_left < 0:
            raise ValueError("the metadata holds more values than a model's header can "
                             f"(at most {MAX_METADATA_VALUES:,}); refusing to read it")

    def scalar(self, fmt: str):
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("Q")
        value = bytes(self.buf[self.pos:self.pos + length]).decode("utf-8", errors="replace")
        self.pos += length
        return value

    def strings(self, count: int) -> list[str]:
        """``count`` strings in a row: string()'s values, in one loop of local names (SmolLM2's
        header, ~100,000 tokens and merges, read in 0.08 s against 0.14 s through string())."""
        buf, pos, length_at, out = self.buf, self.pos, _LENGTH.unpack_from, []
        for _ in range(count):
            (length,) = length_at(buf, pos)
            pos += 8
            out.append(str(buf[pos:pos + length], "utf-8", "replace"))
            pos += length
        self.pos = pos
        return out

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.scalar("I"), self.scalar("Q")
            if count > len(self.buf) - self.pos:  # every item takes at least one byte of the file
                raise ValueError(f"a metadata array claims {count} items, more than the file holds")
            self._count(count)
            if item_kind in _ARRAYS:
                items = array(_ARRAYS[item_kind])
                end = self.pos + items.itemsize * count
                if end > len(self.buf):
                    raise ValueError(f"a metadata array of {count} items runs past the end of the file")
                items.frombytes(self.buf[self.pos:end])
                if sys.byteorder != "little":
                    items.byteswap()
                self.pos = end
                return [bool(x) for x in items] if item_kind == _BOOL else items.tolist()
            if item_kind == _STRING:
                return self.strings(count)
            return [self.value(item_kind) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self.scalar(_SCALARS[kind])


class GGUFError(ValueError):
    """The file is not a GGUF we can read; the message names the file and the problem."""


def open_gguf(path: str) -> tuple[dict, list["TensorInfo"]]:
    """(metadata, tensors) of ``path``, turning any parse failure into a GGUFError naming the file."""
    name = os.path.basename(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model file not found: {name}")
    with open_regular(path, name) as f:  # a FIFO or device is refused, never waited on
        if f.read(4) != MAGIC:
            raise GGUFError(f"{name}: not a GGUF file (bad magic)")
    try:
        return read_gguf_file(path)
    except Exception as e:  # truncation shows up as struct, index or value errors
        raise GGUFError(f"{name}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from e


def read_gguf_file(path: str, max_values: int = MAX_METADATA_VALUES) -> tuple[dict, list[TensorInfo]]:
    """(metadata, tensors); raises ValueError (or struct.error) on a malformed or truncated file."""
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(memoryview(mm), max_values)
    if bytes(cur.buf[:4]) != MAGIC:
        raise ValueError("not a GGUF file (bad magic)")
    cur.pos = 4
    version = cur.scalar("I")
    if version not in (2, 3):
        raise ValueError(f"unsupported GGUF version {version}")
    num_tensors, num_fields = cur.scalar("Q"), cur.scalar("Q")
    meta = {}
    for _ in range(num_fields):
        cur._count(1)
        key = cur.string()
        meta[key] = cur.value(cur.scalar("I"))
    infos = []
    for _ in range(num_tensors):
        cur._count(1)
        name = cur.string()
        ndims = cur.scalar("I")
        if not 1 <= ndims <= MAX_TENSOR_DIMS:
            raise ValueError(f"tensor {name} has {ndims} dimensions (1 to {MAX_TENSOR_DIMS} allowed)")
        shape = [cur.scalar("Q") for _ in range(ndims)]
        qtype = GGMLType(cur.scalar("I"))
        infos.append((name, shape, qtype, cur.scalar("Q")))
    alignment = int(meta.get("general.alignment", DEFAULT_ALIGNMENT))
    if not 1 <= alignment <= 1 << 20:
        raise ValueError(f"general.alignment must be 1 to 1 MiB, got {alignment}")
    data_start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, shape, qtype, offset in infos:
        block_size, type_size = BLOCK_SIZES[qtype]
        elements = 1
        for dim in shape:  # Python ints: a crafted shape must not wrap around to a small size
            elements *= dim
        if elements == 0 or shape[0] % block_size:
            raise ValueError(f"tensor {name} has shape {shape}, not whole blocks of {block_size}")
        n_bytes = elements // block_size * type_size
        start = data_start + offset
        if start + n_bytes > len(mm):
            raise ValueError(f"tensor {name} runs past the end of the file (truncated?)")
        tensors.append(TensorInfo(name, shape, qtype, start, n_bytes, mm))
    return meta, tensors
