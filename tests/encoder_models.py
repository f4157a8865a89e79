"""Tiny random encoder models made with transformers (the oracle) for the encoder tests: a BERT
sentence-embedding model in the sentence-transformers layout, XLM-RoBERTa with a Unigram tokenizer,
nomic-bert, cross-encoders (BERT and XLM-RoBERTa ``ForSequenceClassification`` with one label), and
a GGUF written from the BERT one with the ``gguf`` package in llama.cpp's ``bert`` layout."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

WORDS = ("the a an of to and in is it that for on with as was he she they we you this at by from be are or not "
         "cat dog bird fish river sea mountain city house car train plane book music paris france capital "
         "water cycle rain cloud sun moon star tree leaf autumn poem story dragon fly machine learning fruit "
         "color red green blue yellow what how why where who when tell me about describe list write short").split()
LETTERS = "abcdefghijklmnopqrstuvwxyz0123456789.,!?'-"
TEXTS = ["The cat sat on the river bank.", "How do planes fly?", "Paris is the capital of France.",
         "A short poem about autumn leaves and the sea.", "water", "Describe the water cycle: rain, cloud, sun!"]
QUERY = "what is the capital of france?"
DOCUMENTS = ["Paris is the capital of France.", "The dragon flew over the mountain.",
             "Machine learning is a field of study.", "France has a capital city.", "the cat and the dog"]


def _fast(tok, **special):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, **special)


def wordpiece_tokenizer():
    """An uncased WordPiece tokenizer ([CLS] A [SEP] B [SEP]), as bert-base-uncased frames inputs."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    vocab = dict.fromkeys(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *LETTERS, *("##" + c for c in LETTERS),
                           *WORDS])
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.decoder = decoders.WordPiece()
    return _fast(tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
                 mask_token="[MASK]", model_input_names=["input_ids", "token_type_ids", "attention_mask"])


def unigram_tokenizer():
    """A SentencePiece-style Unigram tokenizer framed as XLM-RoBERTa's: <s> A </s> </s> B </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    pieces = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -5.0) for c in LETTERS] + [("\u2581" + w, -3.0 - len(w) / 10) for w in dict.fromkeys(WORDS)
                                              if len(w) > 1]
    tok = Tokenizer(models.Unigram(pieces, unk_id=3))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
                                                       special_tokens=[("<s>", 0), ("</s>", 2)])
    return _fast(tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
                 cls_token="<s>", sep_token="</s>", mask_token="<unk>")


def _small(config_class, vocab_size: int, **extra):
    torch.manual_seed(0)
    return config_class(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=128, **extra)


def _randomise_norms(model) -> None:
    """Random LayerNorm weights and biases: a wrong norm or bias mapping then shows in the vectors."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name or "layernorm" in name or name.endswith("bias"):
                p.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)


def write_sentence_transformer(path: Path, model, tokenizer, pooling: str, normalize: bool,
                               max_seq_length: int | None = None) -> Path:
    """Save ``model`` as a sentence-transformers folder (Transformer + Pooling [+ Normalize])."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models

    raw = path.parent / f"{path.name}-raw"
    model.save_pretrained(raw)
    tokenizer.save_pretrained(raw)
    transformer = models.Transformer(str(raw), max_seq_length=max_seq_length)
    modules = [transformer, models.Pooling(model.config.hidden_size, pooling_mode=pooling)]
    SentenceTransformer(modules=modules + ([models.Normalize()] if normalize else []), device="cpu").save(str(path))
    return path


def bert_embedder(path: Path, pooling: str = "mean", normalize: bool = True, max_seq_length: int | None = 32):
    from transformers import BertConfig, BertModel

    tokenizer = wordpiece_tokenizer()
    model = BertModel(_small(BertConfig, len(tokenizer)), add_pooling_layer=False).eval()
    _randomise_norms(model)
    return write_sentence_transformer(path, model, tokenizer, pooling, normalize, max_seq_length)


def xlm_roberta_embedder(path: Path):
    from transformers import XLMRobertaConfig, XLMRobertaModel

    tokenizer = unigram_tokenizer()
    config = _small(XLMRobertaConfig, len(tokenizer), pad_token_id=1, bos_token_id=0, eos_token_id=2,
                    type_vocab_size=1)
    model = XLMRobertaModel(config, add_pooling_layer=False).eval()
    _randomise_norms(model)
    return write_sentence_transformer(path, model, tokenizer, "cls", normalize=False)


def nomic_bert_embedder(path: Path):
    from transformers import NomicBertConfig, NomicBertModel

    tokenizer = wordpiece_tokenizer()
    model = NomicBertModel(_small(NomicBertConfig, len(tokenizer), head_dim=16)).eval()
    _randomise_norms(model)
    return write_sentence_transformer(path, model, tokenizer, "mean", normalize=True)


def cross_encoder(path: Path, family: str = "bert") -> Path:
    """A ``*ForSequenceClassification`` with one label: a cross-encoder reranker."""
    from transformers import BertConfig, BertForSequenceClassification, XLMRobertaConfig, \
        XLMRobertaForSequenceClassification

    if family == "bert":
        tokenizer = wordpiece_tokenizer()
        model = BertForSequenceClassification(_small(BertConfig, len(tokenizer), num_labels=1))
    else:
        tokenizer = unigram_tokenizer()
        model = XLMRobertaForSequenceClassification(_small(XLMRobertaConfig, len(tokenizer), num_labels=1,
                                                           pad_token_id=1, type_vocab_size=1))
    model.eval()
    _randomise_norms(model)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def oracle_vectors(path: Path, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu").encode(texts, convert_to_numpy=True)


def oracle_scores(path: Path, query: str, documents: list[str]) -> list[float]:
    """transformers' logits for each (query, document), through a sigmoid."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        batch = tokenizer([query] * len(documents), documents, padding=True, return_tensors="pt")
        return torch.sigmoid(model(**batch).logits[:, 0]).tolist()


def cosines(a, b) -> list[float]:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return list((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1))


_GGUF_NAMES = {  # llama.cpp's tensor_mapping for these checkpoints' names
    "bert": {"embeddings.word_embeddings": "token_embd", "embeddings.position_embeddings": "position_embd",
             "embeddings.token_type_embeddings": "token_types", "embeddings.LayerNorm": "token_embd_norm",
             "attention.self.query": "attn_q", "attention.self.key": "attn_k", "attention.self.value": "attn_v",
             "attention.output.dense": "attn_output", "attention.output.LayerNorm": "attn_output_norm",
             "intermediate.dense": "ffn_up", "output.dense": "ffn_down", "output.LayerNorm": "layer_output_norm"},
    "xlm-roberta": {"embeddings.word_embeddings": "token_embd", "embeddings.position_embeddings": "position_embd",
                    "embeddings.token_type_embeddings": "token_types", "embeddings.LayerNorm": "token_embd_norm",
                    "attention.self.query": "attn_q", "attention.self.key": "attn_k",
                    "attention.self.value": "attn_v", "attention.output.dense": "attn_output",
                    "attention.output.LayerNorm": "attn_output_norm", "intermediate.dense": "ffn_up",
                    "output.dense": "ffn_down", "output.LayerNorm": "layer_output_norm"},
    "nomic-bert": {"embeddings.word_embeddings": "token_embd", "embeddings.token_type_embeddings": "token_types",
                   "emb_ln": "token_embd_norm", "attn.Wqkv": "attn_qkv", "attn.out_proj": "attn_output",
                   "mlp.fc11": "ffn_up", "mlp.fc12": "ffn_gate", "mlp.fc2": "ffn_down", "norm1": "attn_output_norm",
                   "norm2": "layer_output_norm"},
}


def write_xlm_roberta_gguf(st_folder: Path, out: Path, pooling_type: int = 2) -> Path:
    """XLM-RoBERTa as llama.cpp's XLMRobertaModel converter writes it: arch ``bert``, a ``t5`` (Unigram)
    vocabulary with its scores, and the first padding_idx + 1 position rows dropped (positions from 0)."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((st_folder / "config.json").read_text())
    model = json.loads((st_folder / "tokenizer.json").read_text())["model"]
    tokens, scores = [p[0] for p in model["vocab"]], [p[1] for p in model["vocab"]]
    offset = config["pad_token_id"] + 1
    writer = _encoder_header(out, "bert", config, pooling_type, config["max_position_embeddings"] - offset)
    writer.add_tokenizer_model("t5")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types([gguf.TokenType.CONTROL if t in ("<s>", "<pad>", "</s>") else
                            gguf.TokenType.UNKNOWN if t == "<unk>" else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_type_count(config["type_vocab_size"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(1)
    writer.add_unk_token_id(3)
    state = load_file(str(st_folder / "model.safetensors"))
    state["embeddings.position_embeddings.weight"] = state["embeddings.position_embeddings.weight"][offset:]
    _encoder_tensors(writer, state, _GGUF_NAMES["xlm-roberta"])
    return out


def _encoder_header(out: Path, arch: str, config: dict, pooling_type: int, context_length: int):
    import gguf

    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_context_length(context_length)
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_layer_norm_eps(config["layer_norm_eps"])
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType(pooling_type))
    return writer


def _encoder_tensors(writer, state: dict, names: dict) -> None:
    for name, tensor in state.items():
        stem, kind = name.rsplit(".", 1)
        if stem.startswith("pooler."):  # an embedding model's GGUF leaves the pooler out, as llama.cpp's does
            continue
        if stem in names:
            gguf_name = f"{names[stem]}.{kind}"
        else:
            _, _, i, rest = stem.split(".", 3)  # encoder.layer(s).N.rest
            gguf_name = f"blk.{i}.{names[rest]}.{kind}"
        writer.add_tensor(gguf_name, tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_bert_gguf(st_folder: Path, out: Path, pooling_type: int = 1, arch: str = "bert") -> Path:
    """The sentence-transformers model as llama.cpp's convert_hf_to_gguf writes it: arch ``bert`` (q/k/v
    apart) or ``nomic-bert`` (q/k/v stacked, rotary, gated MLP), the phantom-space WordPiece vocabulary,
    ``{arch}.pooling_type`` (1 mean, 2 cls)."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((st_folder / "config.json").read_text())
    vocab = json.loads((st_folder / "tokenizer.json").read_text())["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    control = {i for i, t in enumerate(tokens) if t.startswith("[") and t.endswith("]")}
    spelled = [t if i in control else t[2:] if t.startswith("##") else "\u2581" + t for i, t in enumerate(tokens)]
    writer = _encoder_header(out, arch, config, pooling_type, config["max_position_embeddings"])
    if arch == "nomic-bert":
        writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_tokenizer_model("bert")
    writer.add_token_list(spelled)
    writer.add_token_types([gguf.TokenType.CONTROL if i in control else gguf.TokenType.NORMAL
                            for i in range(len(tokens))])
    writer.add_token_type_count(config["type_vocab_size"])
    writer.add_uint32("tokenizer.ggml.cls_token_id", vocab["[CLS]"])
    writer.add_sep_token_id(vocab["[SEP]"])
    writer.add_pad_token_id(vocab["[PAD]"])
    writer.add_unk_token_id(vocab["[UNK]"])
    _encoder_tensors(writer, load_file(str(st_folder / "model.safetensors")), _GGUF_NAMES[arch])
    return out
