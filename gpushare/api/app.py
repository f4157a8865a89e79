"""The aiohttp application: both dialects' routes behind one error middleware."""

from __future__ import annotations

from aiohttp import web

from gpushare.api import ollama, openai
from gpushare.api.context import CONTEXT, ApiContext
from gpushare.api.errors import error_middleware

MAX_BODY_BYTES = 64 << 20  # long prompts and embedding batches, not uploads


def build_app(ctx: ApiContext) -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=MAX_BODY_BYTES)
    app[CONTEXT] = ctx
    ollama.add_routes(app)
    openai.add_routes(app)
    return app
