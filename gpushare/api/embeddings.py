"""Embeddings shared by both dialects: tokenise, truncate to the context, `engine.embed`."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from gpushare.api.context import context, encode_text, off_loop
from gpushare.api.errors import ApiError, bad_request
from gpushare.api.limits import check_count, check_prompt_chars, limits_of
from gpushare.api.streaming import Timings, engine_failed, lease_limits
from gpushare.api.tenants import admit, check_keep_alive
from gpushare.protocol.request import EmbedRequest, EngineFailed, KVCacheBusy, check_embed, usable_context


async def embed_texts(request: web.Request, model: str, inputs: list[str | list[int]], keep_alive: float | None,
                      truncate: bool = True) -> tuple[list[list[float]], Timings]:
    """One vector per input (text, or token ids); no inputs only loads the model. At most
    limits.max_embed_inputs inputs of limits.max_embed_tokens tokens in all."""
    check_keep_alive(request, keep_alive)
    limits = limits_of(request)
    check_count("input", len(inputs), "inputs", "max_embed_inputs", limits)
    check_prompt_chars((item for item in inputs if isinstance(item, str)), "input", limits)
    ctx = context(request)
    timings = Timings()
    async with admit(request, model) as ticket, ctx.registry.use(model, keep_alive) as lease:
        timings.load_s = lease.load_duration_s
        if not inputs:
            return [], timings
        model_limits, tenant_limit_bytes = lease_limits(lease, ticket.tenant, ctx.node.tenant_policies)
        limit = usable_context(model_limits)  # truncation fits the model, never a tenant's kv_limit (a 400)
        token_lists = []
        encoded = await off_loop(lambda: [encode_text(lease.model, x) if isinstance(x, str) else x for x in inputs])
        for i, ids in enumerate(encoded):
            if not ids:
                raise bad_request(f"input[{i}] is empty", param="input")
            if len(ids) > limit:
                if not truncate:
                    raise bad_request(f"input[{i}] is {len(ids)} tokens, longer than the context of {limit} tokens",
                                      param="input")
                ids = ids[:limit]
            token_lists.append(ids)
        timings.prompt_tokens = sum(len(ids) for ids in token_lists)
        check_count("input", timings.prompt_tokens, "tokens", "max_embed_tokens", limits)
        ticket.charge_tokens(timings.prompt_tokens, timings)
        embed = EmbedRequest(lease.entry.name, token_lists, ticket.tenant)
        try:
            check_embed(token_lists, model_limits, tenant_limit_bytes, ticket.tenant)
            vectors = await asyncio.wrap_future(lease.device.embed(embed))
        except ValueError as e:
            raise bad_request(str(e)) from None
        except KVCacheBusy as e:
            raise ApiError(503, str(e), retry_after_s=1) from None
        except EngineFailed as e:
            raise engine_failed(e) from None
        timings.end_s = time.monotonic()
        return vectors, timings
