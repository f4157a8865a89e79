"""Constrained decoding with llguidance: a grammar per sequence, token masks applied to its logits.

A request's ``StructuredOutput`` (a JSON Schema, or any JSON object) is compiled into an
``LLMatcher`` on the caller's thread when the sequence is made (``new_matcher``), so a bad schema
fails before the engine sees it. On the engine thread, ``apply_masks`` computes the allowed tokens
of every constrained row of a step at once (llguidance's thread pool, outside the GIL) and sets
the others to -inf; ``advance`` moves a matcher past the sampled token. A step with no constrained
sequence never calls into this module. torch is imported only by the functions that touch logits:
the daemon's supervisor checks schemas here and must not load it.
"""

from __future__ import annotations

import functools
import json
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance

if TYPE_CHECKING:  # torch only where masks are applied: the supervisor checks schemas without it
    import torch

JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON: a small model cannot loop on whitespace
_executor: llguidance.LLExecutor | None = None
_vocab_lock = threading.Lock()


class SchemaError(ValueError):
    """A schema that is invalid, or uses a feature the grammar compiler does not enforce."""


@dataclass
class StructuredOutput:
    """What the output must be: valid against ``json_schema``, or (``json_object``) any JSON object, or
    (``lark``) an llguidance Lark grammar (thinking, then what follows it: api/thinking.py)."""
    json_schema: dict | None = None
    json_object: bool = False
    lark: str | None = None

    def schema(self) -> dict:
        return self.json_schema if self.json_schema is not None else {"type": "object"}


def check_schema(schema) -> str:
    """The llguidance grammar of a JSON Schema; SchemaError saying what is wrong with it or what of it
    cannot be enforced (an unknown keyword is refused rather than silently not enforced)."""
    if not isinstance(schema, (dict, bool)):
        raise SchemaError(f"must be a JSON Schema object, got {json.dumps(schema)[:80]}")
    return _grammar(json.dumps(schema))  # key order kept: properties are written in the order given


@functools.lru_cache(maxsize=128)  # clients send the same few schemas again and again; compiling can take 0.1 s
def _grammar(schema_text: str) -> str:
    schema = json.loads(schema_text)
    import jsonschema  # the meta-schema check names invalid schemas the way their authors' tools do

    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise SchemaError(f"is not a valid JSON Schema{' at ' + where if where else ''}: {e.message}") from None
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as e:
        raise SchemaError(f"is not a valid JSON Schema: {e}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error or messages:
        raise SchemaError(f"cannot be enforced: {'; '.join(messages)}")
    return grammar


def grammar_vocab(loaded) -> llguidance.LLTokenizer:
    """The model's vocabulary as llguidance sees it (built once per loaded model, ~0.2 s)."""
    with _vocab_lock:
        if loaded.grammar_vocab is None:
            tokenizer = loaded.tokenizer
            loaded.grammar_vocab = llguidance.LLTokenizer(
                tokenizer.hf.to_str(), n_vocab=max(tokenizer.vocab_size, loaded.config.vocab_size),
                eos_token=sorted(loaded.stop_token_ids))
        return loaded.grammar_vocab


def check_lark(source: str) -> str:
    """The llguidance grammar of a Lark grammar; SchemaError when it does not compile. Token references
    (``<[id]>``) are checked against the vocabulary when the matcher is built."""
    grammar = llguidance.grammar_from("lark", source)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise SchemaError(f"cannot be enforced: {'; '.join(messages)}")
    return grammar


def new_matcher(loaded, structured: StructuredOutput) -> llguidance.LLMatcher:
    grammar = check_lark(structured.lark) if structured.lark is not None else check_schema(structured.schema())
    matcher = llguidance.LLMatcher(grammar_vocab(loaded), grammar, log_level=0)
    if matcher.is_error():
        raise SchemaError(f"the grammar failed to build: {matcher.get_error()}")
    return matcher


def _executor_for_engine() -> llguidance.LLExecutor:
    global _executor
    import torch

    if _executor is None:  # the engine thread only; as many workers as the engine's torch threads
        _executor = llguidance.LLExecutor(num_threads=max(1, torch.get_num_threads()))
    return _executor


def apply_masks(logits: torch.Tensor, matchers: list) -> list[str | None]:
    """Set every token the row's grammar forbids to -inf, in place; ``matchers[i]`` is row i's
    matcher or None (unconstrained, untouched). Returns per row None, or why it cannot go on."""
    import torch

    rows = [i for i, m in enumerate(matchers) if m is not None]
    vocab = logits.shape[-1]
    bitmask = torch.full((len(rows), (vocab + 31) // 32), -1, dtype=torch.int32)
    # Imported here: llguidance.torch costs ~190 MB of resident memory, which a process that never
    # runs a constrained step (most engines) should not pay.
    from llguidance.torch import fill_next_token_bitmask_par

    fill_next_token_bitmask_par(_executor_for_engine(), [(matchers[r], k) for k, r in enumerate(rows)], bitmask)
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)[:, :vocab].bool()
    index = torch.tensor(rows, device=logits.device)
    allowed = allowed.to(logits.device)
    with torch.inference_mode():  # the model's logits are inference tensors
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    problems: list[str | None] = [None] * len(matchers)
    empty = (~allowed.any(dim=1)).tolist()
    for k, r in enumerate(rows):
        if matchers[r].is_error() or empty[k]:
            problems[r] = f"the output grammar allows no next token ({matchers[r].get_error() or 'dead end'})"
    return problems


def advance(matcher: llguidance.LLMatcher, token: int) -> None:
    """Move past the sampled token (always one the mask allowed)."""
    if not matcher.consume_token(token):
        raise RuntimeError(f"the output grammar refused token {token}: {matcher.get_error()}")


def finished(matcher: llguidance.LLMatcher) -> bool:
    """True once the grammar is complete and nothing may follow: the sequence stops there."""
    return matcher.is_stopped()
