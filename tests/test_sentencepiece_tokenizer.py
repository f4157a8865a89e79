"""A Gemma-style SentencePiece BPE vocabulary in a GGUF (as llama.cpp's converter writes Gemma's:
pieces, scores, token types, no space prefix) encodes and decodes as SentencePiece itself does.

No Gemma vocabulary can be downloaded here, so the test trains a small one with Gemma's settings
(byte fallback, digits split, whitespace kept, turn markers as user-defined pieces).
"""

import io
import os

import pytest

from gpushare.catalog.model_head import stop_ids
from gpushare.catalog.tokenizer import tokenizer_from_gguf

spm = pytest.importorskip("sentencepiece")

TEXTS = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "data", "us_founding_texts.txt")
# SentencePiece piece types -> GGUF token types (llama.cpp): normal 1, unknown 2, control 3,
# user-defined 4, unused 5, byte 6.
SAMPLES = ["When in the Course of human events, it becomes necessary",
           "  two leading spaces, tabs\tand\nnew lines\n\n",
           "Numbers: 1776, 3.14159 and 42!",
           "Unicode: café, naïve, Ω, 東京, and an emoji 🙂 that needs bytes",
           "<start_of_turn>user\nHello there<end_of_turn>\n<start_of_turn>model\n"]


@pytest.fixture(scope="module")
def gemma_like():
    lines = [line for line in open(TEXTS, encoding="utf-8").read().splitlines() if line.strip()]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=1200, model_type="bpe",
        byte_fallback=True, split_digits=True, add_dummy_prefix=False, remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, normalization_rule_name="identity", character_coverage=1.0,
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, user_defined_symbols=["<start_of_turn>", "<end_of_turn>"])
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.add_space_prefix": False,
            "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.bos_token_id": 2,
            "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 3,
            "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(sp.get_piece_size())],
            "tokenizer.ggml.scores": [sp.get_score(i) for i in range(sp.get_piece_size())],
            "tokenizer.ggml.token_type": [_token_type(sp, i) for i in range(sp.get_piece_size())]}
    return sp, meta


def _token_type(sp, i: int) -> int:
    if sp.is_unknown(i):
        return 2
    if sp.is_control(i):
        return 3
    if sp.is_byte(i):
        return 6
    if sp.id_to_piece(i) in ("<start_of_turn>", "<end_of_turn>"):
        return 4
    return 1


@pytest.mark.parametrize("text", SAMPLES)
def test_encodes_and_decodes_as_sentencepiece(gemma_like, text):
    sp, meta = gemma_like
    ours = tokenizer_from_gguf(meta)
    assert ours.encode(text) == sp.encode(text)
    assert ours.encode(text, add_special_tokens=True) == [2] + sp.encode(text)
    assert ours.decode(sp.encode(text)) == sp.decode(sp.encode(text))


def test_inputs_tokenised_in_batches_are_those_of_one_at_a_time(gemma_like):
    """A decoder's inputs to embed, batched (Tokenizer.encode_inputs): BOS first, cut the same way."""
    tokenizer = tokenizer_from_gguf(gemma_like[1])
    for limit in (8, 512):
        assert tokenizer.encode_inputs(SAMPLES, limit) == [tokenizer.encode_input(t, limit) for t in SAMPLES]


def test_gemma_turn_end_marker_stops_generation(gemma_like):
    sp, meta = gemma_like
    tokenizer = tokenizer_from_gguf(meta)
    assert stop_ids(tokenizer, [1]) == {1, sp.piece_to_id("<end_of_turn>")}

