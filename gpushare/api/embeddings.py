"""Embeddings and relevance scores shared by the dialects: tokenise as the model frames its inputs,
truncate to its context (or refuse), run one EmbedRequest through the engine, Matryoshka ``dimensions``.

A model serves what its kind says (LoadedModel.kind): chat models generate and embed, embedding
models embed, rerankers score; asking a model for what it does not serve is a 400 that says what it is for.
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys
import time

import orjson
from aiohttp import web

from gpushare.api.context import context
from gpushare.api.errors import ApiError, bad_request
from gpushare.api.idle_work import in_idle_time
from gpushare.api.limits import check_count, check_prompt_chars, limits_of
from gpushare.api.streaming import Timings, engine_failed, lease_limits
from gpushare.api.tenants import admit, check_keep_alive
from gpushare.api.work import bounded
from gpushare.catalog.tokenise_child import tokenised
from gpushare.protocol.request import EmbedRequest, EngineFailed, KVCacheBusy, Vectors, check_embed, usable_context

PIECE_ROWS = 64  # vectors formatted a piece of a large answer: ~0.4 ms for 384 values each
# A request of more inputs than this is tokenised in the engine's idle time (api/idle_work.py), this
# many a piece (~2 ms of a core for short texts), and by the handler's own thread once it has
# waited IDLE_PATIENCE_S for it (beside 64 streams 4,000 inputs took ~1 s).
IDLE_PIECE_INPUTS = 32
IDLE_PATIENCE_S = 3.0
SERVES = {"chat": ("chat", "embed"), "embedding": ("embed",), "rerank": ("rerank",)}
_FOR = {"chat": "chat and completion (and embeddings)", "embedding": "embeddings (/api/embed, /v1/embeddings)",
        "rerank": "reranking (/v1/rerank, /v1/score)"}


def check_serves(loaded, name: str, task: str) -> None:
    """400 unless the model serves ``task`` (chat | embed | rerank)."""
    kind = loaded.kind
    if task not in SERVES[kind]:
        article = "an" if kind[0] in "aeiou" else "a"
        raise bad_request(f'"{name}" is {article} {kind} model: it serves {_FOR[kind]}, not {task}', param="model")


def _encoded(loaded, op: str, items: list, limit: int) -> list:
    """``tokenised(loaded.tokenizer, op, items, limit)``; a large request's in the engine's idle time."""
    if len(items) <= IDLE_PIECE_INPUTS:
        return tokenised(loaded.tokenizer, op, items, limit)
    return in_idle_time(loaded.tokenizer, op, items, limit, IDLE_PIECE_INPUTS, IDLE_PATIENCE_S)


def _tokenised(loaded, inputs: list, limit: int, truncate: bool) -> list[list[int]]:
    """Token ids per input (text framed by the model's special tokens, or ids as given), cut to ``limit``."""
    texts = [item for item in inputs if isinstance(item, str)]
    encoded = iter(_encoded(loaded, "inputs", texts, limit))
    out = []
    for i, item in enumerate(inputs):
        ids, full = next(encoded) if isinstance(item, str) else (item[:limit], len(item))
        if not full:
            raise bad_request(f"input[{i}] is empty", param="input")
        if full > limit and not truncate:
            raise bad_request(f"input[{i}] is {full} tokens, longer than the context of {limit} tokens "
                              "(truncate: true cuts it to fit)", param="input")
        out.append(ids)
    return out


def _pairs(loaded, pairs: list[tuple[str, str]], limit: int) -> tuple[list[list[int]], list[list[int]] | None]:
    encoded = _encoded(loaded, loaded.pair_op, pairs, limit)
    types = [pair_types for _, pair_types in encoded]
    return [ids for ids, _ in encoded], (types if all(t is not None for t in types) else None)


def vector_json(vector) -> str:
    """A float32 vector as a JSON array (each value the float64 repr of its float32: it reads back as
    exactly that float32). orjson writes 4,000 vectors of 384 in ~120 ms of CPU, where the json module
    took 1.3-1.8 s of the supervisor's, CPU that the engine's steps lost. (orjson's numpy path would
    write float32's own shortest decimals, but the supervisor never loads numpy.)"""
    return orjson.dumps(vector.tolist()).decode()


def vector_base64(vector) -> str:
    """A vector's float32 values, little-endian, as a base64 JSON string (OpenAI's encoding_format)."""
    if sys.byteorder == "big":
        vector = vector[:]
        vector.byteswap()
    return '"' + base64.b64encode(vector.tobytes()).decode() + '"'


async def rows_response(request: web.Request, fields: dict, key: str, count: int, row_json) -> web.StreamResponse:
    """The JSON object ``fields`` with ``key``: [row_json(0), ..., row_json(count - 1)] last. A large answer
    is written PIECE_ROWS rows a piece, the event loop let go between pieces, so that formatting it never
    holds back for long the streams this process relays."""
    head = json.dumps({**fields, key: []})[:-2]  # through the array's "["
    if count <= PIECE_ROWS:
        return web.Response(text=head + ",".join(map(row_json, range(count))) + "]}", content_type="application/json")
    response = web.StreamResponse(headers={"Content-Type": "application/json; charset=utf-8"})
    await response.prepare(request)
    await response.write(head.encode())
    for start in range(0, count, PIECE_ROWS):
        piece = ",".join(map(row_json, range(start, min(start + PIECE_ROWS, count))))
        await response.write(("," if start else "").encode() + piece.encode())
        await asyncio.sleep(0)  # the loop's other work (every stream's next token) between pieces
    await response.write(b"]}")
    await response.write_eof()
    return response


async def embed_texts(request: web.Request, model: str, inputs: list[str | list[int]], keep_alive: float | None,
                      truncate: bool = True, dimensions: int | None = None) -> tuple[Vectors | list, Timings]:
    """One vector per input (text, or token ids), cut to Matryoshka ``dimensions`` (then L2-normalised
    again); no inputs only loads the model. At most limits.max_embed_inputs inputs of
    limits.max_embed_tokens tokens in all."""
    check_prompt_chars((item for item in inputs if isinstance(item, str)), "input", limits_of(request))
    if dimensions is not None and (not isinstance(dimensions, int) or isinstance(dimensions, bool) or dimensions < 1):
        raise bad_request(f'"dimensions" must be a positive integer, got {dimensions!r}', param="dimensions")

    def tokenise(loaded, limit):
        width = loaded.config.hidden_size
        if dimensions is not None and dimensions > width:
            raise bad_request(f'"dimensions" ({dimensions}) is larger than the model\'s {width}', param="dimensions")
        return _tokenised(loaded, inputs, limit, truncate), None

    return await _run(request, model, keep_alive, len(inputs), "embed", tokenise, dimensions)


async def score_pairs(request: web.Request, model: str, pairs: list[tuple[str, str]],
                      keep_alive: float | None = None) -> tuple[list[float], Timings]:
    """One relevance score in [0, 1] per (query, document) pair, from a reranking model; each pair is cut
    to the model's context (the longer text first)."""
    check_prompt_chars([text for pair in pairs for text in pair], "documents", limits_of(request))
    return await _run(request, model, keep_alive, len(pairs), "rerank",
                      lambda loaded, limit: _pairs(loaded, pairs, limit))


async def _run(request: web.Request, model: str, keep_alive: float | None, count: int, task: str, tokenise,
               dimensions: int | None = None):
    """Admit, lease the model, tokenise (``tokenise(loaded, limit) -> (ids, type_ids)``), run the engine."""
    check_keep_alive(request, keep_alive)
    limits = limits_of(request)
    check_count("input", count, "inputs", "max_embed_inputs", limits)
    ctx = context(request)
    timings = Timings()
    async with admit(request, model) as ticket, ctx.registry.use(model, keep_alive) as lease:
        timings.load_s = lease.load_duration_s
        if not count:
            return [], timings
        check_serves(lease.model, model, task)
        if lease.entry.base is not None:  # the engine runs adapters in generation steps only
            raise bad_request(f'model "{model}" is a LoRA adapter (on "{lease.entry.base.name}"): it generates, it '
                              f"does not embed or score", param="model")
        model_limits, tenant_limit_bytes = lease_limits(lease, ticket.tenant, ctx.node.tenant_policies)
        limit = usable_context(model_limits)  # truncation fits the model, never a tenant's kv_limit (a 400)

        def checked(loaded) -> tuple:  # in the pool: 4,000 inputs' ids took ~8 ms to check, on the event loop
            ids, types = tokenise(loaded, limit)
            try:
                check_embed(ids, model_limits, tenant_limit_bytes, ticket.tenant)
            except ValueError as e:
                raise bad_request(str(e)) from None
            return ids, types

        token_lists, type_ids = await bounded(request, "tokenising the inputs", checked, lease.model)
        timings.prompt_tokens = sum(len(ids) for ids in token_lists)
        check_count("input", timings.prompt_tokens, "tokens", "max_embed_tokens", limits)
        ticket.charge_tokens(timings.prompt_tokens, timings)
        embed = EmbedRequest(lease.entry.name, token_lists, ticket.tenant, type_ids=type_ids,
                             task="score" if task == "rerank" else "embed", dimensions=dimensions)
        try:
            results = await asyncio.wrap_future(lease.device.embed(embed))
        except ValueError as e:
            raise bad_request(str(e)) from None
        except KVCacheBusy as e:
            raise ApiError(503, str(e), retry_after_s=1) from None
        except EngineFailed as e:
            raise engine_failed(e) from None
        timings.end_s = time.monotonic()
        return results, timings
