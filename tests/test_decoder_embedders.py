"""Decoders that embed or rerank, as their files declare: a Qwen3-Embedding-like model (sentence-transformers
last-token pooling + Normalize over a bare Qwen3Model) against sentence-transformers, and a
Qwen3-Reranker-like model (yes/no token) against its model card's transformers recipe. Tiny random
Qwen3 models made here with transformers."""

from pathlib import Path

import pytest
import torch
from arch_models import hf_to_gguf, save_hf_model
from encoder_models import DOCUMENTS, QUERY, TEXTS, WORDS, cosines, oracle_vectors, write_sentence_transformer

from gpushare.engine.engine import Engine
from gpushare.protocol.engine_config import EngineConfig
from gpushare.protocol.request import EmbedRequest
from gpushare.catalog.llm_rerank import DEFAULT_INSTRUCTION, _PREFIX, _SUFFIX
from gpushare.models.loader import load_model
from gpushare.catalog.model_head import load_model_head

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]


def decoder_tokenizer(append_eos: bool):
    """A WordPiece vocabulary as a decoder's tokenizer: no [CLS]; with ``append_eos``, <|endoftext|> ends
    every input (as Qwen3-Embedding's tokenizer.json does)."""
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = dict.fromkeys(["[UNK]", *SPECIAL, "yes", "no", ":", "<", ">", "\"", ".", *WORDS,
                           *"abcdefghijklmnopqrstuvwxyz", *("##" + c for c in "abcdefghijklmnopqrstuvwxyz")])
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    if append_eos:
        tok.post_processor = processors.TemplateProcessing(single="$A <|endoftext|>",
                                                           special_tokens=[("<|endoftext|>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   unk_token="[UNK]", padding_side="left")


def qwen3_config(vocab_size: int, **extra):
    from transformers import Qwen3Config

    torch.manual_seed(0)
    return Qwen3Config(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=256,
                       **extra)


@pytest.fixture(scope="module")
def engine():
    engine = Engine(EngineConfig(kv_dtype="float32", kv_cache_bytes=8 << 20))
    engine.start()
    yield engine
    engine.shutdown()


def test_a_last_token_embedding_model_equals_sentence_transformers(tmp_path, engine):
    from transformers import Qwen3Model

    tokenizer = decoder_tokenizer(append_eos=True)
    model = Qwen3Model(qwen3_config(len(tokenizer), tie_word_embeddings=True)).eval()
    path = write_sentence_transformer(tmp_path / "qwen3-embed", model, tokenizer, "lasttoken", normalize=True)
    head = load_model_head(str(path), "float32")
    assert (head.kind, head.pooling.mode) == ("embedding", "last")
    loaded = load_model(str(path), weights="float32")
    engine.add_model("embed", loaded)
    ids = [loaded.tokenizer.encode_input(t, 256)[0] for t in TEXTS]
    assert all(x[-1] == tokenizer.eos_token_id for x in ids)  # the EOS its tokenizer appends is the token pooled
    vectors = engine.embed(EmbedRequest("embed", ids)).result(timeout=120)
    engine.remove_model("embed")
    assert min(cosines(vectors, oracle_vectors(path, TEXTS))) > 1 - 1e-5


def model_card_scores(path: Path, query: str, documents: list[str], tokenizer=None) -> list[float]:
    """Qwen3-Reranker's model card recipe with transformers: P(yes) over {yes, no} at the last token;
    ``tokenizer`` (default: AutoTokenizer's for ``path``) to tokenise with."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = tokenizer or AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    prefix = tokenizer.encode(_PREFIX, add_special_tokens=False)
    suffix = tokenizer.encode(_SUFFIX, add_special_tokens=False)
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    scores = []
    for doc in documents:
        text = f"<Instruct>: {DEFAULT_INSTRUCTION}\n<Query>: {query}\n<Document>: {doc}"
        ids = prefix + tokenizer(text, add_special_tokens=False)["input_ids"] + suffix
        with torch.no_grad():
            last = model(torch.tensor([ids])).logits[0, -1]
        scores.append(torch.log_softmax(torch.stack([last[no], last[yes]]), dim=0)[1].exp().item())
    return scores


def test_a_yes_no_llm_reranker_scores_as_its_model_card(tmp_path, engine):
    from transformers import Qwen3ForCausalLM

    tokenizer = decoder_tokenizer(append_eos=False)
    path = tmp_path / "qwen3-rerank"
    Qwen3ForCausalLM(qwen3_config(len(tokenizer))).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "README.md").write_text("# Qwen3-Reranker-tiny\n\nA tiny random model for tests.\n")
    loaded = load_model(str(path), weights="float32")
    assert loaded.kind == "rerank"
    engine.add_model("rerank", loaded)
    pairs = loaded.pair_inputs([(QUERY, d) for d in DOCUMENTS], 256)
    assert all(types is None for _, types in pairs)
    scores = engine.embed(EmbedRequest("rerank", [ids for ids, _ in pairs], task="score")).result(timeout=120)
    engine.remove_model("rerank")
    assert scores == pytest.approx(model_card_scores(path, QUERY, DOCUMENTS), abs=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_a_gguf_llm_reranker_scores_as_its_model_card(tmp_path, engine, smollm2_path, tied):
    """Qwen3-Reranker as llama.cpp converts it (cls.output holds the LM head's yes and no rows; the LM
    head itself is left out): the scores equal transformers' on the Hugging Face model it came from."""
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path / "qwen3-rerank"
    save_hf_model("qwen3", str(folder), smollm2_path, tie_word_embeddings=tied)
    # SmolLM2's tokenizer, which the GGUF carries (AutoTokenizer would take Qwen2's pre-tokenizer, from
    # config.json's model type, and split "\n\n</think>" otherwise).
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    yes_no = (tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no"))
    path = hf_to_gguf(str(folder), str(tmp_path / "rerank.gguf"), smollm2_path, yes_no=yes_no)
    loaded = load_model(path, weights="float32")
    assert loaded.kind == "rerank"
    engine.add_model("rerank-gguf", loaded)
    pairs = loaded.pair_inputs([(QUERY, d) for d in DOCUMENTS], 256)
    scores = engine.embed(EmbedRequest("rerank-gguf", [ids for ids, _ in pairs], task="score")).result(timeout=120)
    engine.remove_model("rerank-gguf")
    expected = model_card_scores(folder, QUERY, DOCUMENTS, tokenizer)
    assert scores == pytest.approx(expected, abs=1e-5)
    assert sorted(range(len(scores)), key=scores.__getitem__) == sorted(range(len(expected)), key=expected.__getitem__)


def test_a_decoder_gguf_marked_rank_without_yes_no_labels_is_refused_by_name():
    from gpushare.catalog.pooling import pooling_from_gguf

    with pytest.raises(ValueError, match=r"qwen3.classifier.output_labels \["):
        pooling_from_gguf({"general.architecture": "qwen3", "qwen3.pooling_type": 4})
    assert pooling_from_gguf({"general.architecture": "qwen3", "qwen3.pooling_type": 4,
                              "qwen3.classifier.output_labels": ["yes", "no"]}).mode == "rank"
    assert pooling_from_gguf({"general.architecture": "qwen3", "qwen3.pooling_type": 3}).mode == "last"
