"""What every handler needs: the node's devices, the registry, the settings; and prompt encoding."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from aiohttp import web

from gpushare.api.errors import bad_request
from gpushare.settings.settings import Settings
from gpushare.residency.node_devices import NodeDevices
from gpushare.residency.registry import Registry


@dataclass
class ApiContext:
    node: NodeDevices  # every device's engine as one: node-wide stats, tenant policies, liveness
    registry: Registry
    settings: Settings  # replaced whole by a config reload (SIGHUP)
    started_at: float = field(default_factory=time.time)
    phase: str = "starting"  # "starting" (preloading) | "serving" | "draining": /ready and the drain read it
    in_flight: int = 0  # requests being handled, monitoring endpoints excluded (api/health.py counts them)
    engine_stall_s: float = 30.0  # /health fails once the engine loop has been silent this long
    tenants: object = None  # gpushare.api.tenants.TenantGate, set by build_app
    supervisor: object = None  # gpushare.residency.device_supervisor.DeviceSupervisor: the engine workers
    pulls: object = None  # gpushare.catalog.pull.Pulls: the pulls under way, set by build_app


CONTEXT = web.AppKey("gpushare", ApiContext)


def context(request: web.Request) -> ApiContext:
    return request.app[CONTEXT]


async def off_loop(fn, *args):
    """``fn(*args)`` in the default thread pool: templating and tokenising a long prompt must not
    hold the event loop (other requests' streams, /health) meanwhile."""
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


# Prompts are encoded exactly as the offline LLM API does (gpushare/llm.py), so that a
# greedy answer through HTTP equals LLM.generate / LLM.chat for the same input.

def encode_text(model, text: str) -> list[int]:
    """A raw completion prompt: BOS added when the model asks for it."""
    return model.tokenizer.encode(text, add_special_tokens=True)


def encode_chat(model, messages: list[dict], **extra) -> list[int]:
    """A conversation through the model's chat template (which writes its own special tokens);
    ``extra``: more template variables (``tools``)."""
    try:
        text = model.render_chat(messages, add_generation_prompt=True, **extra)
    except ValueError as e:  # TemplateError: the template refused these messages
        raise bad_request(str(e), param="messages") from None
    return model.tokenizer.encode(text, add_special_tokens=False)
