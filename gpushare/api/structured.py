"""Structured output requests in both dialects: Ollama's ``format`` and OpenAI's ``response_format``
become a ``StructuredOutput`` (the engine constrains decoding to it); a bad or unenforceable schema
is a 400 naming the field."""

from __future__ import annotations

from gpushare.api.errors import bad_request
from gpushare.protocol.structured_output import SchemaError, StructuredOutput, check_schema


def _checked(schema, param: str) -> StructuredOutput:
    try:
        check_schema(schema)
    except SchemaError as e:
        raise bad_request(f'"{param}" {e}', param=param) from None
    return StructuredOutput(json_schema=schema)


def ollama_format(body: dict) -> StructuredOutput | None:
    """``format``: "" (none), "json" (any JSON object) or a JSON Schema object."""
    value = body.get("format")
    if value is None or value == "":
        return None
    if value == "json":
        return StructuredOutput(json_object=True)
    if isinstance(value, dict):
        return _checked(value, "format")
    raise bad_request('"format" must be "json" or a JSON Schema object', param="format")


def openai_response_format(body: dict) -> StructuredOutput | None:
    """``response_format``: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}}. The output is held to the schema either way: with
    a grammar, ``strict`` false would only allow less."""
    value = body.get("response_format")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request('"response_format" must be an object with a "type"', param="response_format")
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind != "json_schema":
        raise bad_request(f'"response_format.type" must be "text", "json_object" or "json_schema", got {kind!r}',
                          param="response_format.type")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request('"response_format.json_schema" must be an object with "name" and "schema"',
                          param="response_format.json_schema")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise bad_request('"response_format.json_schema.name" is required', param="response_format.json_schema.name")
    if not isinstance(spec.get("strict", False), bool):
        raise bad_request('"response_format.json_schema.strict" must be a boolean',
                          param="response_format.json_schema.strict")
    schema = spec.get("schema", {"type": "object"})
    return _checked(schema, "response_format.json_schema.schema")
