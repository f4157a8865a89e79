"""Reranking: ``POST /v1/rerank`` and ``/rerank`` (the request and answer llama.cpp's server, Jina and
Cohere use) and ``POST /v1/score`` (vLLM's), served by reranking models (cross-encoders).

Rerank request: ``model``, ``query``, ``documents`` (strings, or objects with a ``text``), ``top_n``
(default: all), ``return_documents`` (default true, as Jina). Answer: ``results`` sorted by
``relevance_score`` (a sigmoid of the cross-encoder's logit, in [0, 1]) with each document's ``index``.
"""

from __future__ import annotations

import uuid

from aiohttp import web

from gpushare.api.embeddings import score_pairs
from gpushare.api.errors import bad_request
from gpushare.api.fields import field, read_json_object, required_string


def _documents(body: dict) -> list[str]:
    raw = body.get("documents")
    if not isinstance(raw, list):
        raise bad_request('"documents" must be an array of strings', param="documents")
    texts = []
    for i, doc in enumerate(raw):
        text = doc.get("text") if isinstance(doc, dict) else doc
        if not isinstance(text, str):
            raise bad_request(f'"documents[{i}]" must be a string or an object with a "text" string',
                              param="documents")
        texts.append(text)
    return texts


def _top_n(body: dict, count: int) -> int:
    top_n = body.get("top_n")
    if top_n is None:
        return count
    if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 1:
        raise bad_request(f'"top_n" must be a positive integer, got {top_n!r}', param="top_n")
    return min(top_n, count)


def _usage(timings) -> dict:
    return {"prompt_tokens": timings.prompt_tokens, "total_tokens": timings.prompt_tokens}


async def rerank(request: web.Request) -> web.Response:
    body = await read_json_object(request)
    model = required_string(body, "model")
    query = required_string(body, "query")
    documents = _documents(body)
    top_n = _top_n(body, len(documents))
    return_documents = field(body, "return_documents", "boolean", True)
    if not documents:
        raise bad_request('"documents" is empty: there is nothing to rank', param="documents")
    scores, timings = await score_pairs(request, model, [(query, d) for d in documents])
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:top_n]
    results = [{"index": i, "relevance_score": scores[i],
                **({"document": {"text": documents[i]}} if return_documents else {})} for i in order]
    return web.json_response({"id": f"rerank-{uuid.uuid4().hex}", "model": model, "object": "list",
                              "usage": _usage(timings), "results": results})


def _texts(body: dict, name: str) -> list[str]:
    raw = body.get(name)
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list) or not items or not all(isinstance(x, str) for x in items):
        raise bad_request(f'"{name}" must be a string or a non-empty array of strings', param=name)
    return items


async def score(request: web.Request) -> web.Response:
    """vLLM's /v1/score: ``text_1`` (one query, or as many as ``text_2``) against each ``text_2``."""
    body = await read_json_object(request)
    model = required_string(body, "model")
    first, second = _texts(body, "text_1"), _texts(body, "text_2")
    if len(first) not in (1, len(second)):
        raise bad_request(f'"text_1" has {len(first)} texts: give one, or as many as "text_2" ({len(second)})',
                          param="text_1")
    queries = first * len(second) if len(first) == 1 else first
    scores, timings = await score_pairs(request, model, list(zip(queries, second)))
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    return web.json_response({"id": f"score-{uuid.uuid4().hex}", "object": "list", "model": model, "data": data,
                              "usage": _usage(timings)})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/rerank", rerank)
    app.router.add_post("/rerank", rerank)
    app.router.add_post("/v1/score", score)
