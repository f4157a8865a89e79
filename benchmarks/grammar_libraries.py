"""The grammar libraries side by side: token-mask cost at batch 16 and JSON Schema correctness.

    .venv/bin/python benchmarks/grammar_libraries.py          # each library that is installed

Candidates: llguidance (what the engine uses, engine/constraints.py), xgrammar, outlines-core; the
other two are not dependencies of gpushare: `pip install xgrammar outlines-core` to compare. All run
on SmolLM2's vocabulary. Speed: 16 matchers walk a valid answer to a schema (an array of 8 records)
token by token; each step computes the 16 token masks one after another (the engine's own call,
llguidance's parallel fill, is faster still) and the mean per step is printed. Correctness: per JSON
Schema feature, a valid instance must be accepted token by token and an invalid one refused; a
library that compiles a schema but lets the invalid instance through ignores that feature silently.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from conftest import smollm2_gguf_path  # noqa: E402

RECORD = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
BENCH_SCHEMA = {"type": "array", "items": RECORD, "minItems": 8}
BENCH_ANSWER = [{"name": f"person number {i}", "age": 20 + i} for i in range(8)]

FEATURES = [  # (feature, schema, a valid instance, an invalid one)
    ("required", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, {"a": 1}, {}),
    ("additionalProperties false", {"type": "object", "properties": {"a": {"type": "integer"}},
                                    "additionalProperties": False}, {"a": 1}, {"a": 1, "b": 2}),
    ("enum", {"enum": ["red", "green"]}, "red", "blue"),
    ("const", {"const": 7}, 7, 8),
    ("minLength/maxLength", {"type": "string", "minLength": 2, "maxLength": 3}, "abc", "abcdef"),
    ("pattern", {"type": "string", "pattern": "^[0-9]{3}$"}, "123", "12a"),
    ("minimum/maximum", {"type": "integer", "minimum": 1, "maximum": 9}, 5, 12),
    ("minItems/maxItems", {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}, [1, 2], [1]),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, True, "x"),
    ("$ref/$defs", {"$defs": {"n": {"type": "integer"}}, "type": "array", "items": {"$ref": "#/$defs/n"}},
     [1, 2], ["a"]),
    ("format date", {"type": "string", "format": "date"}, "2026-12-01", "tomorrow"),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 2], [1, 1]),
]


def token_bytes(tokenizer) -> list[bytes]:
    """Each token id's bytes (GPT-2 byte-level BPE strings mapped back to bytes)."""
    chars = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    codes = chars[:]
    extra = 0
    for b in range(256):
        if b not in chars:
            chars.append(b)
            codes.append(256 + extra)
            extra += 1
    to_byte = {chr(c): b for b, c in zip(chars, codes)}
    out = []
    for i in range(tokenizer.hf.get_vocab_size()):
        text = tokenizer.hf.id_to_token(i) or ""
        out.append(bytes(to_byte[ch] for ch in text) if all(ch in to_byte for ch in text) else text.encode())
    return out


def ids_of(tokenizer, value) -> list[int]:
    return tokenizer.hf.encode(json.dumps(value, separators=(",", ":")), add_special_tokens=False).ids


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab, eos):
        import llguidance

        self.lib = llguidance
        self.tok = llguidance.LLTokenizer(tokenizer.hf.to_str(), n_vocab=len(vocab), eos_token=eos)
        self.n_vocab = len(vocab)

    def compile(self, schema):
        grammar = self.lib.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        is_error, messages = self.lib.LLMatcher.validate_grammar_with_warnings(grammar)
        if is_error or messages:
            raise ValueError("; ".join(messages))
        return grammar

    def matcher(self, compiled):
        return self.lib.LLMatcher(self.tok, compiled, log_level=0)

    def mask(self, m, buffer):
        m.compute_bitmask()

    def accept(self, m, token) -> bool:
        return m.consume_token(token) and not m.is_error()

    def done(self, m) -> bool:
        return m.is_accepting()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab, eos):
        import xgrammar

        self.lib = xgrammar
        info = xgrammar.TokenizerInfo(vocab, vocab_type=xgrammar.VocabType.RAW, vocab_size=len(vocab),
                                      stop_token_ids=eos)
        self.compiler = xgrammar.GrammarCompiler(info)
        self.bitmask = xgrammar.allocate_token_bitmask(1, len(vocab))

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))

    def matcher(self, compiled):
        return self.lib.GrammarMatcher(compiled)

    def mask(self, m, buffer):
        m.fill_next_token_bitmask(self.bitmask)

    def accept(self, m, token) -> bool:
        return m.accept_token(token)

    def done(self, m) -> bool:
        return m.is_completed() if hasattr(m, "is_completed") else m.is_terminated()


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer, vocab, eos):
        import outlines_core

        self.lib = outlines_core
        tokens: dict[bytes, list[int]] = {}
        for i, b in enumerate(vocab):
            if i not in eos and b:
                tokens.setdefault(b, []).append(i)
        self.vocab = outlines_core.Vocabulary(eos[0], tokens)
        self.mask_tensor = torch.zeros((len(vocab) + 31) // 32, dtype=torch.int32)

    def compile(self, schema):
        from outlines_core.json_schema import build_regex_from_schema

        return self.lib.Index(build_regex_from_schema(json.dumps(schema)), self.vocab)

    def matcher(self, compiled):
        return self.lib.Guide(compiled)

    def mask(self, m, buffer):
        m.write_mask_into(self.mask_tensor.data_ptr(), self.mask_tensor.numel(), self.mask_tensor.element_size())

    def accept(self, m, token) -> bool:
        try:
            m.advance(token)
            return True
        except ValueError:
            return False

    def done(self, m) -> bool:
        return m.is_finished()


def walk(lib, compiled, ids) -> bool:
    m = lib.matcher(compiled)
    return all(lib.accept(m, t) for t in ids) and lib.done(m)


def main() -> int:
    from gpushare.models.loader import load_model

    loaded = load_model(smollm2_gguf_path(), weights="float32")
    tokenizer = loaded.tokenizer
    vocab = token_bytes(tokenizer)
    eos = sorted(loaded.stop_token_ids)
    answer_ids = ids_of(tokenizer, BENCH_ANSWER)
    rows = {}
    for cls in (Llguidance, Xgrammar, OutlinesCore):
        try:
            lib = cls(tokenizer, vocab, eos)
        except ImportError as e:
            rows[cls.name] = f"not installed ({e.name})"
            continue
        t0 = time.perf_counter()
        compiled = lib.compile(BENCH_SCHEMA)
        compile_ms = (time.perf_counter() - t0) * 1e3
        matchers = [lib.matcher(compiled) for _ in range(16)]
        t0 = time.perf_counter()
        for token in answer_ids:
            for m in matchers:
                lib.mask(m, None)
                assert lib.accept(m, token), f"{cls.name} refused the valid benchmark answer"
        step_ms = (time.perf_counter() - t0) * 1e3 / len(answer_ids)
        verdicts = []
        for feature, schema, good, bad in FEATURES:
            try:
                c = lib.compile(schema)
            except Exception as e:  # each library raises its own error types
                verdicts.append((feature, f"refused ({type(e).__name__})"))
                continue
            ok_good, ok_bad = walk(lib, c, ids_of(tokenizer, good)), walk(lib, c, ids_of(tokenizer, bad))
            verdicts.append((feature, "enforced" if ok_good and not ok_bad else
                             "IGNORED (invalid accepted)" if ok_bad else "WRONG (valid refused)"))
        rows[cls.name] = (compile_ms, step_ms, verdicts)

    print(f"SmolLM2 vocabulary ({len(vocab)} tokens); benchmark answer {len(answer_ids)} tokens; "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'library':<14} {'compile ms':>11} {'16 masks ms/step':>17}")
    for name, row in rows.items():
        print(f"{name:<14} {row}" if isinstance(row, str) else f"{name:<14} {row[0]:>11.1f} {row[1]:>17.2f}")
    print()
    names = [n for n, r in rows.items() if not isinstance(r, str)]
    print(f"{'JSON Schema feature':<28} " + " ".join(f"{n:<28}" for n in names))
    for i, (feature, *_) in enumerate(FEATURES):
        print(f"{feature:<28} " + " ".join(f"{rows[n][2][i][1]:<28}" for n in names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
