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
    ("block_count", 10 ** 9, r"llama.block_count 1000000000 is out of range \(1 to 1024, the cap on num_layers\)"),
    ("attention.head_count_kv", 0, "num_kv_heads 0 is out of range"),
])
def test_architecture_numbers_are_bounded(smollm2_path, key, value, message):
    meta, _ = open_gguf(smollm2_path)
    assert config_from_gguf(meta).context_length == 8192
    with pytest.raises(ValueError, match=message):
        config_from_gguf({**meta, f"llama.{key}": value})


def test_a_hf_config_with_absurd_layers_is_refused_before_sizing_anything():
    from gpushare.catalog.model_config import config_from_hf

    raw = {"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 200_000_000, "num_attention_heads": 4, "sliding_window": 16}
    with pytest.raises(ValueError, match=r"num_hidden_layers 200000000 is out of range \(1 to 1024, the cap on "
                                         r"num_layers\)"):
        config_from_hf(raw)


def test_merge_recovery_caps_are_checked_before_any_split():
    from gpushare.catalog.tokenizer import MAX_PIECE_CHARS, MAX_RECOVERY_SPLITS, recovered_merges

    vocab = {t: i for i, t in enumerate(["a", "b", "ab", "ba", "aba"])}
    # higher scores first, then by the pieces' ids, as SentencePiece ranks them
    assert recovered_merges(vocab, [0.0, 0.0, -1.0, -2.0, -0.5]) == [("a", "ba"), ("ab", "a"), ("a", "b"), ("b", "a")]
    with pytest.raises(ValueError, match=f"a token of {MAX_PIECE_CHARS + 1} characters"):
        recovered_merges({"a" * (MAX_PIECE_CHARS + 1): 0}, [0.0])
    many = {f"{i:07d}" + "x" * 493: i for i in range(MAX_RECOVERY_SPLITS // 499 + 1)}
    with pytest.raises(ValueError, match=f"at most {MAX_RECOVERY_SPLITS} \\(MAX_RECOVERY_SPLITS\\)"):
        recovered_merges(many, [0.0] * len(many))


def test_model_files_stay_in_their_folder_and_are_regular(tmp_path):
    import os

    from gpushare.catalog.model_files import ModelFileError, read_json, read_text, weight_files

    outside = tmp_path / "outside.txt"
    outside.write_text("secret")
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "chat_template.jinja").symlink_to(outside)
    with pytest.raises(ModelFileError, match="chat_template.jinja is a symbolic link that leaves") as info:
        read_text(str(folder), "chat_template.jinja")
    assert str(outside) not in str(info.value)
    os.mkfifo(folder / "model.safetensors")
    with pytest.raises(ModelFileError, match="model.safetensors is not a regular file"):
        weight_files(str(folder))
    assert read_json(str(folder), "absent.json", {}) == {}
    # a Hugging Face cache snapshot links into its repository's blobs/: allowed
    repo = tmp_path / "hub" / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc123").write_text('{"model_type": "llama"}')
    snapshot = repo / "snapshots" / "rev1"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").symlink_to("../../blobs/abc123")
    assert read_json(str(snapshot), "config.json") == {"model_type": "llama"}


@pytest.mark.parametrize("key, value, message", [
    ("bert.block_count", 2_000_000_000, r"num_layers 2000000000 is out of range \(1 to 1024, the cap on num_layers\)"),
    ("bert.context_length", 1 << 40, "context_length 1099511627776 is out of range"),
    ("tokenizer.ggml.token_type_count", 1 << 40, "type_vocab_size 1099511627776 is out of range"),
    ("bert.attention.head_count", 7, "hidden_size 64 is not a multiple of num_heads 7"),
])
def test_an_encoder_header_with_absurd_numbers_is_refused(key, value, message):
    from gpushare.catalog.encoder_config import encoder_config_from_gguf

    meta = {"general.architecture": "bert", "tokenizer.ggml.tokens": ["a"] * 30, "bert.embedding_length": 64,
            "bert.feed_forward_length": 128, "bert.block_count": 2, "bert.attention.head_count": 4,
            "bert.context_length": 512}
    assert encoder_config_from_gguf(meta).num_layers == 2
    with pytest.raises(ValueError, match=message):
        encoder_config_from_gguf({**meta, key: value})
