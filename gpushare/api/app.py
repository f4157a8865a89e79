"""The aiohttp application: every dialect's routes (Ollama, OpenAI, Anthropic, Responses), health,
metrics and the status page, behind the middlewares."""

from __future__ import annotations

from aiohttp import web

from gpushare.api import (anthropic, health, metrics, ollama, ollama_models, ollama_pull, openai, rerank, responses,
                          status, status_history, ui)
from gpushare.api.browsers import add_cors_headers, browser_middleware
from gpushare.api.context import CONTEXT, ApiContext
from gpushare.api.errors import error_middleware
from gpushare.api.tenants import apply_tenant_settings, tenant_middleware
from gpushare.catalog.pull import Pulls

def pull_cap_bytes_per_s(ctx: ApiContext) -> int | None:
    """What a pull's download may take while a loaded model has requests (server.pull_rate_while_serving):
    on a fast link its copies cost those requests' TTFT (catalog/pull_child.py). None while idle."""
    busy = any(entry.active for entry in ctx.registry.loaded())
    return (ctx.settings.server.pull_rate_while_serving_bytes_per_s or None) if busy else None


def build_app(ctx: ApiContext) -> web.Application:
    # Outermost first: metrics sees the final status; a foreign page is turned away, and a browser's
    # preflight answered, before anything else; draining answers 503 before a key is asked for.
    middlewares = [metrics.metrics_middleware, error_middleware, browser_middleware, health.drain_middleware,
                   tenant_middleware]
    # Bodies are read by api/fields.read_json_object against limits.max_body_bytes as it is now (a
    # reload may change it); aiohttp's own cap is for any other read, at the limit of the start.
    app = web.Application(middlewares=middlewares, client_max_size=ctx.settings.limits.max_body_bytes)
    app.on_response_prepare.append(add_cors_headers)
    app[CONTEXT] = ctx
    apply_tenant_settings(ctx, ctx.settings)
    ctx.pulls = Pulls(lambda: ctx.settings.models_dir, lambda: pull_cap_bytes_per_s(ctx),
                      lambda: ctx.settings.server.max_pulls)
    app.on_cleanup.append(lambda _: ctx.pulls.close())
    ollama.add_routes(app)
    ollama_models.add_routes(app)
    ollama_pull.add_routes(app)
    openai.add_routes(app)
    anthropic.add_routes(app)
    responses.add_routes(app)
    rerank.add_routes(app)
    health.add_routes(app)
    status_history.setup(app, ctx)
    metrics.setup(app, ctx)
    status.add_routes(app)
    ui.add_routes(app)
    return app
