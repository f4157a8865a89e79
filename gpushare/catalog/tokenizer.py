"""Tokenizer built with the `tokenizers` library from GGUF metadata or a `tokenizer.json`."""

import os
from dataclasses import dataclass, field

from tokenizers import (AddedToken, Regex, Tokenizer as HFTokenizer, decoders, models, normalizers, pre_tokenizers,
                        processors)

from gpushare.catalog.model_files import MAX_JSON_BYTES, read_bytes, read_json

# Merge recovery's caps (recovered_merges): SentencePiece trains pieces of at most 16 characters by default
# (its own ceiling is 512); Gemma's 256k vocabulary has about 2M splits.
MAX_PIECE_CHARS = 512
MAX_RECOVERY_SPLITS = 1 << 22
# GGUF token types (llama.cpp): 3 = control (special), 4 = user-defined (added, not special).
_CONTROL, _USER_DEFINED = 3, 4
BATCH_INPUTS = 256  # texts per call of the tokenizers library's batch call (Tokenizer._batched)

# Split regexes for llama.cpp's `tokenizer.ggml.pre` names whose merges were learned on them.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "smaug-bpe": _LLAMA3_SPLIT}


@dataclass
class Tokenizer:
    hf: HFTokenizer
    bos_token: str | None = None
    eos_token: str | None = None
    add_bos: bool = False
    special_ids: set = field(default_factory=set)
    encoder: bool = False  # the tokenizer's own post-processor frames inputs ([CLS] ... [SEP], pairs)

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=False).ids
        return self._bos_first(ids) if add_special_tokens else ids

    def encode_texts(self, texts: list[str]) -> list[list[int]]:
        """``encode`` for many texts, through the library's batch call."""
        return [encoding.ids for encoding in self._batched(texts, add_special_tokens=False)]

    def _batched(self, texts: list[str], add_special_tokens: bool):
        """Each text's encoding in order, from the library's batch call BATCH_INPUTS texts at a time. The
        batch call lets go of Python's lock while it works: tokenising 4,000 inputs one by one held it for
        ~190 ms, and the supervisor's event loop, which relays every stream's tokens, got it back only
        each 5 ms."""
        for start in range(0, len(texts), BATCH_INPUTS):
            yield from self.hf.encode_batch(texts[start:start + BATCH_INPUTS], add_special_tokens=add_special_tokens)

    def _bos_first(self, ids: list[int]) -> list[int]:
        """``ids`` after the BOS token, where the model reads one."""
        return [self.hf.token_to_id(self.bos_token)] + ids if self.add_bos and self.bos_token is not None else ids

    def encode_input(self, text: str, max_tokens: int) -> tuple[list[int], int]:
        """An input as the model reads it, framed by its special tokens (an encoder's [CLS] ... [SEP], a
        decoder's BOS) and cut to ``max_tokens`` keeping the frame; returns (ids, its length uncut)."""
        if not self.encoder:
            ids = self.encode(text, add_special_tokens=True)
            return ids[:max_tokens], len(ids)
        encoding = self.hf.encode(text, add_special_tokens=False)
        extra = self.hf.num_special_tokens_to_add(False)
        full = len(encoding.ids) + extra
        if full > max_tokens:
            encoding.truncate(max(0, max_tokens - extra))
        return self.hf.post_process(encoding).ids, full

    def encode_inputs(self, texts: list[str], max_tokens: int) -> list[tuple[list[int], int]]:
        """encode_input for many texts, through the library's batch call."""
        out = []
        for text, encoding in zip(texts, self._batched(texts, add_special_tokens=self.encoder)):
            ids = encoding.ids
            if self.encoder:
                out.append((ids, len(ids)) if len(ids) <= max_tokens else self.encode_input(text, max_tokens))
                continue
            ids = self._bos_first(ids)
            out.append((ids[:max_tokens], len(ids)))
        return out

    def encode_pairs(self, pairs: list[tuple[str, str]], max_tokens: int) -> list[tuple[list[int], list[int], int]]:
        """(query, document) pairs as a cross-encoder reads them: (ids, token type ids, length uncut) each,
        the longer of the two cut first when too long (the tokenizers library's longest_first). The texts
        go through the library's batch call."""
        extra = self.hf.num_special_tokens_to_add(True)
        firsts = self._batched([first for first, _ in pairs], add_special_tokens=False)
        seconds = self._batched([second for _, second in pairs], add_special_tokens=False)
        out = []
        for a, b in zip(firsts, seconds):
            la, lb = len(a.ids), len(b.ids)
            full = la + lb + extra
            excess = full - max_tokens
            if excess > 0:
                cut = min(excess, max(0, la - lb))
                la, excess = la - cut, excess - cut
                cut = min(excess, max(0, lb - la))
                lb, excess = lb - cut, excess - cut
                la, lb = max(0, la - excess // 2), max(0, lb - (excess - excess // 2))
                a.truncate(la)
                b.truncate(lb)
            encoding = self.hf.post_process(a, b)
            out.append((encoding.ids, encoding.type_ids, full))
        return out

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str) -> HFTokenizer:
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    if pre in _SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    elif pre == "smollm":
        # SmolLM's own tokenizer.json: every digit alone, then GPT-2's byte-level split.
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(tokens: list[str], scores: list[float], merges: list[str] | None, add_space_prefix: bool):
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges] if merges else recovered_merges(vocab, scores)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token="<unk>" if "<unk>" in vocab else None,
                                 fuse_unk=True, byte_fallback=True))
    steps = [normalizers.Replace(" ", "\u2581")]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend("\u2581"))
    tok.normalizer = normalizers.Sequence(steps)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else [])
    )
    return tok


def recovered_merges(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """Merges of a vocabulary that lists none: every split of a token into two known pieces, ranked by
    the token's score (higher merges first), as SentencePiece does. A token of n characters has n - 1
    splits and each copies it, so the caps (MAX_PIECE_CHARS, MAX_RECOVERY_SPLITS) are checked over the
    whole vocabulary before any split is made: a crafted file of long tokens would make this cubic."""
    longest = max(map(len, vocab), default=0)
    if longest > MAX_PIECE_CHARS:
        raise ValueError(f"a token of {longest} characters in a vocabulary without merges: recovering merges "
                         f"takes tokens of at most {MAX_PIECE_CHARS} characters (MAX_PIECE_CHARS)")
    splits = sum(len(token) - 1 for token in vocab if token)
    if splits > MAX_RECOVERY_SPLITS:
        raise ValueError(f"a vocabulary without merges whose tokens have {splits} splits: recovering merges "
                         f"takes at most {MAX_RECOVERY_SPLITS} (MAX_RECOVERY_SPLITS)")
    score, left_ids, right_ids = [], [], []
    for token, i in vocab.items():
        for cut in range(1, len(token)):
            left, right = vocab.get(token[:cut]), vocab.get(token[cut:])
            if left is not None and right is not None:
                score.append(-scores[i])
                left_ids.append(left)
                right_ids.append(right)
    # numpy arrays, not tuples of strings: a few bytes a merge while they are ranked (imported here, for
    # the vocabularies that need it: the supervisor otherwise runs without numpy's ~15 MiB)
    import numpy as np

    order = np.lexsort((np.array(right_ids, np.int64), np.array(left_ids, np.int64), np.array(score, np.float64)))
    text = {i: token for token, i in vocab.items()}
    return [(text[left_ids[k]], text[right_ids[k]]) for k in order.tolist()]


def tokenizer_from_gguf(meta: dict) -> Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [])
    if kind == "gpt2":
        hf = _byte_level_bpe(tokens, list(meta["tokenizer.ggml.merges"]), meta.get("tokenizer.ggml.pre", "default"))
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    elif kind == "llama":
        hf = _sentencepiece_bpe(tokens, list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)),
                                meta.get("tokenizer.ggml.merges"), bool(meta.get("tokenizer.ggml.add_space_prefix", True)))
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))
    elif kind == "bert":
        return _wordpiece(meta, tokens, types)
    elif kind == "t5":
        return _unigram(meta, tokens, types)
    else:
        raise ValueError(f"unsupported GGUF tokenizer type {kind!r} (supported: gpt2, llama, bert, t5)")
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, ty in zip(tokens, types) if ty == _CONTROL])
    hf.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED])

    def token(key):
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and int(i) < len(tokens) else None

    special = {i for i, ty in enumerate(types) if ty == _CONTROL}
    return Tokenizer(hf, bos_token=token("bos_token_id"), eos_token=token("eos_token_id"), add_bos=add_bos,
                     special_ids=special)


def _wordpiece(meta: dict, tokens: list[str], types: list[int]) -> Tokenizer:
    """A BERT WordPiece tokenizer from llama.cpp's spelling of its vocabulary (convert_hf_to_gguf's
    BertModel: a word-initial piece gains U+2581, a continuation loses its ``##``, control tokens stay),
    lower-casing as llama.cpp's WPM tokenizer does, framing inputs as [CLS] A [SEP] (B [SEP])."""
    vocab = {}
    for i, (token, kind) in enumerate(zip(tokens, types or [0] * len(tokens))):
        word = token if kind == _CONTROL else token[1:] if token.startswith("\u2581") else "##" + token
        vocab.setdefault(word, i)

    def token_id(name, *keys):
        for key in keys:
            if meta.get(f"tokenizer.ggml.{key}") is not None:
                return int(meta[f"tokenizer.ggml.{key}"])
        if name in vocab:  # older converters wrote no id for it
            return vocab[name]
        raise ValueError(f"a BERT GGUF without tokenizer.ggml.{keys[0]} nor a {name} token")

    cls = token_id("[CLS]", "cls_token_id", "bos_token_id")
    sep = token_id("[SEP]", "seperator_token_id", "eos_token_id")
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    hf = HFTokenizer(models.WordPiece(vocab, unk_token=tokens[int(unk)] if unk is not None else "[UNK]",
                                      max_input_chars_per_word=100))
    hf.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, lowercase=True)
    hf.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    hf.post_processor = processors.TemplateProcessing(
        single=f"{tokens[cls]} $A {tokens[sep]}", pair=f"{tokens[cls]} $A {tokens[sep]} $B:1 {tokens[sep]}:1",
        special_tokens=[(tokens[cls], cls), (tokens[sep], sep)])
    hf.decoder = decoders.WordPiece()
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, ty in zip(tokens, types) if ty == _CONTROL])
    special = {i for i, ty in enumerate(types) if ty == _CONTROL}
    return Tokenizer(hf, bos_token=tokens[cls], eos_token=tokens[sep], special_ids=special, encoder=True)


def _unigram(meta: dict, tokens: list[str], types: list[int]) -> Tokenizer:
    """XLM-RoBERTa's SentencePiece Unigram (bge-m3, mxbai) from llama.cpp's ``t5`` vocabulary: pieces
    and scores, its precompiled normaliser, U+2581 word starts; inputs framed <s> A </s> (</s> B </s>)."""
    scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    unk = int(meta.get("tokenizer.ggml.unknown_token_id", 3))
    hf = HFTokenizer(models.Unigram(list(zip(tokens, map(float, scores))), unk_id=unk, byte_fallback=False))
    charsmap = meta.get("tokenizer.ggml.precompiled_charsmap")
    steps = [normalizers.Precompiled(bytes(charsmap))] if charsmap else []
    if meta.get("tokenizer.ggml.remove_extra_whitespaces", True):
        steps.append(normalizers.Replace(Regex(" {2,}"), " "))
    if steps:
        hf.normalizer = normalizers.Sequence(steps)
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.decoder = decoders.Metaspace()
    bos, eos = int(meta.get("tokenizer.ggml.bos_token_id", 0)), int(meta.get("tokenizer.ggml.eos_token_id", 2))
    hf.post_processor = processors.TemplateProcessing(
        single=f"{tokens[bos]} $A {tokens[eos]}", pair=f"{tokens[bos]} $A {tokens[eos]} {tokens[eos]} $B {tokens[eos]}",
        special_tokens=[(tokens[bos], bos), (tokens[eos], eos)])
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, ty in zip(tokens, types) if ty == _CONTROL])
    special = {i for i, ty in enumerate(types) if ty == _CONTROL}
    return Tokenizer(hf, bos_token=tokens[bos], eos_token=tokens[eos], special_ids=special, encoder=True)


def _token_text(value):
    return value.get("content") if isinstance(value, dict) else value


def tokenizer_from_dir(path: str, encoder: bool = False) -> tuple[Tokenizer, dict]:
    """Load ``tokenizer.json``; returns the tokenizer and ``tokenizer_config.json`` (may be empty).
    ``encoder``: its post-processor frames inputs (Tokenizer.encode_input)."""
    text = read_bytes(path, "tokenizer.json", MAX_JSON_BYTES)
    if text is None:
        raise FileNotFoundError(f"{os.path.basename(path)}: no tokenizer.json")
    hf = HFTokenizer.from_str(text.decode("utf-8"))
    hf.no_padding()  # some files pad every input to a fixed length, and cut it (sentence-transformers' do)
    hf.no_truncation()
    cfg = read_json(path, "tokenizer_config.json", {})
    special = {tok.id for tok in _added_tokens(hf) if tok.special}
    return Tokenizer(hf, bos_token=_token_text(cfg.get("bos_token")), eos_token=_token_text(cfg.get("eos_token")),
                     add_bos=bool(cfg.get("add_bos_token", False)), special_ids=special, encoder=encoder), cfg


def _added_tokens(hf: HFTokenizer):
    decoder = hf.get_added_tokens_decoder()
    for i, tok in decoder.items():
        tok.id = i
        yield tok
