"""Ollama's model-management endpoints: /api/show, /api/create, /api/copy, /api/delete, and gpushare's
/api/load (a load with progress).

/api/show answers as Ollama does: the Modelfile that rebuilds the model (`ollama show
--modelfile`), its `parameters` text, template, system prompt, license, MESSAGEs, details,
and `model_info` with the GGUF's own metadata keys (arrays such as the vocabulary only with
`"verbose": true`, which adds the tensors too). /api/create takes Ollama's JSON form
(`from`, `parameters`, `system`, `template`, `messages`, `license`) or an older client's
`modelfile` text; /api/copy registers a model again under a second name.
"""

from __future__ import annotations

import asyncio
import json
import os

from aiohttp import web

from gpushare.api.context import context, off_loop
from gpushare.api.errors import bad_request
from gpushare.api.fields import field, keep_alive_s, read_json_object, required_string
from gpushare.api.ollama import CAPABILITIES, rfc3339
from gpushare.api.thinking import template_thinks
from gpushare.api.tenants import check_admin, check_keep_alive, check_model, is_admin
from gpushare.residency.registry import ModelLoadError, RegistrationError, RegistryFull
from gpushare.model_options import (ModelPreset, OptionError, check_template, messages_from_json, options_from_json,
                                    parameters_text)
from gpushare.modelfile import ModelfileError, format_modelfile, parse_modelfile

LOAD_PROGRESS_INTERVAL_S = 0.1  # /api/load: how often a progress line may be written
HIDDEN_KEYS = ("general.name", "tokenizer.chat_template")  # Ollama leaves these out of model_info too
UNSUPPORTED_CREATE = {"files": "(blob upload) is not supported: name a file on the daemon's machine in \"from\"",
                      "adapters": "is not supported: gpushare does not apply LoRA adapters",
                      "quantize": "is not supported: the weight format is chosen at load (models[].weights)"}


def _gguf_info(path: str, verbose: bool) -> tuple[dict, list[dict]]:
    """The GGUF's metadata as model_info (arrays null unless verbose) and, when verbose, its tensors."""
    from gpushare.models.gguf_reader import open_gguf

    meta, tensors = open_gguf(path)
    info = {k: (v if verbose or not isinstance(v, list) else None) for k, v in meta.items() if k not in HIDDEN_KEYS}
    shown = [{"name": t.name, "type": t.tensor_type.name, "shape": [int(d) for d in t.shape]}
             for t in tensors] if verbose else []
    return info, shown


async def show(request: web.Request) -> web.Response:
    body = await read_json_object(request)
    name = field(body, "model", "string") or field(body, "name", "string")
    if not name:
        raise bad_request('"model" is required', param="model")
    verbose = field(body, "verbose", "boolean", False)
    check_model(request, name)
    registry = context(request).registry
    source = registry.find(name)
    desc = await registry.describe(source.name)
    preset = source.preset
    # Where the node keeps its files is the operator's business: other tenants see the file name only.
    path = source.path if is_admin(request) else os.path.basename(source.path)
    model_info, tensors = desc.model_info, []
    if source.format == "gguf":
        model_info, tensors = await off_loop(_gguf_info, source.path, verbose)
    template = preset.template if preset.template is not None else desc.template or ""
    answer = {
        "modelfile": format_modelfile(path, preset, source.name),
        "parameters": parameters_text(preset.options),
        "template": template,
        "system": preset.system or "", "license": preset.license or "",
        "details": desc.details, "model_info": model_info,
        "capabilities": CAPABILITIES + (["thinking"] if template_thinks(template) else []),
        "modified_at": rfc3339(source.modified_at()), "weights": await registry.weight_format(source.name),
        "kernel": registry.kernel(source.name),  # None until loaded: the worker picks it at load
    }
    if preset.messages:
        answer["messages"] = preset.messages
    if verbose:
        answer["tensors"] = tensors
    return web.json_response(answer)


def _preset_from_body(body: dict) -> ModelPreset:
    """Ollama's JSON create fields as a preset; 400 naming the field that is wrong."""
    try:
        options = options_from_json(field(body, "parameters", "object", {}), "parameters")
        messages = messages_from_json(field(body, "messages", "array", []), "messages")
        template = field(body, "template", "string")
        if template is not None:
            check_template(template, "template")
    except OptionError as e:
        key = str(e).split(":")[0].split(".")[0].split("[")[0]
        raise bad_request(str(e), param=key) from None
    license_value = body.get("license")
    if isinstance(license_value, list) and all(isinstance(x, str) for x in license_value):
        license_value = "\n".join(license_value)
    elif license_value is not None and not isinstance(license_value, str):
        raise bad_request('"license" must be a string or an array of strings', param="license")
    return ModelPreset(options, field(body, "system", "string"), template, messages, license_value)


async def create(request: web.Request) -> web.Response:
    """Register a file, folder or model under a new name, with a Modelfile's presets on top."""
    body = await read_json_object(request)
    name = required_string(body, "model") if "name" not in body else required_string(body, "name")
    for key, why in UNSUPPORTED_CREATE.items():
        if body.get(key):
            raise bad_request(f'"{key}" {why}', param=key)
    check_admin(request, "create models")
    modelfile = field(body, "modelfile", "string")
    if modelfile:  # clients before Ollama 0.5 send the Modelfile's text
        try:
            parsed = parse_modelfile(modelfile, "modelfile")
        except ModelfileError as e:
            raise bad_request(str(e), param="modelfile") from None
        base, preset = parsed.base, parsed.preset
    else:
        base, preset = required_string(body, "from"), _preset_from_body(body)
    try:
        context(request).registry.create(name, base, preset)
    except RegistrationError as e:
        raise bad_request(str(e)) from None
    return web.json_response({"status": "success"})


async def copy(request: web.Request) -> web.Response:
    """{"source", "destination"}: the destination gets the source's weights and presets."""
    body = await read_json_object(request)
    source, destination = required_string(body, "source"), required_string(body, "destination")
    check_admin(request, "copy models")
    check_model(request, source)
    try:
        context(request).registry.create(destination, source)
    except RegistrationError as e:
        raise bad_request(str(e)) from None
    return web.Response(status=200)


async def delete(request: web.Request) -> web.Response:
    body = await read_json_object(request)
    name = field(body, "model", "string") or required_string(body, "name")
    check_admin(request, "delete models")
    try:
        await context(request).registry.remove(name)
    except RegistrationError as e:
        raise bad_request(str(e)) from None
    return web.json_response({})


async def load(request: web.Request) -> web.StreamResponse:
    """gpushare's own: load a model (as a generate with no prompt) and stream its progress as NDJSON,
    as Ollama's /api/pull does: {"status": "queued"|"loading", "completed": bytes, "total": bytes} lines,
    then {"status": "success", "load_duration": ns, "from": the state before: "loaded", "loading", "warm"
    or "on disk"}, or {"error": ...} once streaming."""
    body = await read_json_object(request)
    model = required_string(body, "model")
    check_model(request, model)
    keep_alive = keep_alive_s(body)
    check_keep_alive(request, keep_alive)
    registry = context(request).registry
    source = registry.find(model)
    name, was = source.name, registry.state(source)
    loading = asyncio.ensure_future(registry.load(model, keep_alive))
    try:
        await asyncio.wait({loading}, timeout=LOAD_PROGRESS_INTERVAL_S)
        if loading.done() and loading.exception() is not None:
            raise loading.exception()  # before the first line: a plain HTTP error (404, 503 + Retry-After)
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        last = None
        while not loading.done():
            job = registry.get_loading(name)
            line = job and {"status": job.state, "completed": job.done_bytes, "total": job.total_bytes}
            if line and line != last:
                await response.write(json.dumps(line).encode() + b"\n")
                last = line
            await asyncio.wait({loading}, timeout=LOAD_PROGRESS_INTERVAL_S)
        try:
            lease = loading.result()
            line = {"status": "success", "model": model, "load_duration": int(lease.load_duration_s * 1e9),
                    "from": was}
        except (ModelLoadError, RegistryFull) as e:
            line = {"error": str(e)}
        await response.write(json.dumps(line).encode() + b"\n")
        await response.write_eof()
        return response
    finally:
        loading.cancel()


def add_routes(app: web.Application) -> None:
    app.router.add_post("/api/show", show)
    app.router.add_post("/api/create", create)
    app.router.add_post("/api/copy", copy)
    app.router.add_post("/api/load", load)
    app.router.add_delete("/api/delete", delete)
