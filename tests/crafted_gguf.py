"""Crafted GGUF headers for the file-attack tests, written with the `gguf` package's own writer: a
small valid Llama header with some numbers or the vocabulary replaced. No tensors: every refusal
under test happens on the header, before any weight would be read."""

from __future__ import annotations

from pathlib import Path

from gguf import GGUFWriter

TINY = {"block_count": 2, "context_length": 256, "embedding_length": 64, "feed_forward_length": 128,
        "head_count": 4}


def crafted_gguf(path: Path, tokens: list[str] | None = None, **numbers) -> Path:
    """A Llama GGUF header at ``path``: TINY's numbers with ``numbers`` over them, a SentencePiece
    ("llama") vocabulary ``tokens`` without merges (default: 300 short pieces)."""
    values = {**TINY, **numbers}
    tokens = tokens if tokens is not None else ["<unk>", "<s>", "</s>"] + [f"\u2581t{i}" for i in range(297)]
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(values["block_count"])
    writer.add_context_length(values["context_length"])
    writer.add_embedding_length(values["embedding_length"])
    writer.add_feed_forward_length(values["feed_forward_length"])
    writer.add_head_count(values["head_count"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
