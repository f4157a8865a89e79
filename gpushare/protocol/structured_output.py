"""The structured output a request asks for (``StructuredOutput``: a JSON Schema, or any JSON object)
and the check of a schema, compiled to an llguidance grammar (``check_schema``). No torch: the
supervisor refuses a bad schema with a 400 before any worker sees the request; the engine builds
its per-sequence matchers from the same grammar (engine/constraints.py).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON: a small model cannot loop on whitespace


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
    import llguidance  # here, at the first schema: ~2.5 MiB that a daemon serving none does not hold

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as e:
        raise SchemaError(f"is not a valid JSON Schema: {e}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error or messages:
        raise SchemaError(f"cannot be enforced: {'; '.join(messages)}")
    return grammar


def check_lark(source: str) -> str:
    """The llguidance grammar of a Lark grammar; SchemaError when it does not compile. Token references
    (``<[id]>``) are checked against the vocabulary when the matcher is built."""
    import llguidance

    grammar = llguidance.grammar_from("lark", source)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise SchemaError(f"cannot be enforced: {'; '.join(messages)}")
    return grammar
