"""Ollama's model-management endpoints: /api/tags, /api/ps, /api/show, /api/create, /api/copy,
/api/delete.

/api/show answers as Ollama does: the Modelfile that rebuilds the model (`ollama show
--modelfile`), its `parameters` text, template, system prompt, license, MESSAGEs, details,
and `model_info` with the GGUF's own metadata keys (arrays such as the vocabulary only with
`"verbose": true`, which adds the tensors too). /api/create takes Ollama's JSON form
(`from`, `parameters`, `system`, `template`, `messages`, `license`; or `files` naming a GGUF
blob uploaded to /api/blobs; `adapters` naming one GGUF LoRA blob, or gpushare's `adapter`, a path)
or an older client's `modelfile` text (its ADAPTER too); /api/copy registers a model again under a
second name.
"""

from __future__ import annotations

import os
import time

from aiohttp import web

from gpushare.api.context import context, off_loop
from gpushare.api.errors import bad_request
from gpushare.api.fields import field, read_json_object, required_string
from gpushare.api.memory import memory_report
from gpushare.api.model_defaults import context_room
from gpushare.api.ollama import FOREVER_S, rfc3339
from gpushare.api.tenant_views import own_view, seen_model, tenant_rows
from gpushare.api.tenants import admit, check_admin, check_model, is_admin, visible
from gpushare.api.thinking import template_thinks
from gpushare.catalog.model_catalog import catalog_problems
from gpushare.catalog.blob_store import StoreError, blob_path
from gpushare.residency.registry import RegistrationError
from gpushare.settings.model_options import (ModelPreset, OptionError, check_template, messages_from_json, options_from_json,
                                    parameters_text)
from gpushare.catalog.modelfile import ModelfileError, format_modelfile, parse_modelfile

HIDDEN_KEYS = ("general.name", "tokenizer.chat_template")  # Ollama leaves these out of model_info too
UNSUPPORTED_CREATE = {"quantize": "is not supported: the weight format is chosen at load (models[].weights)"}


def _gguf_info(path: str, verbose: bool) -> tuple[dict, list[dict]]:
    """The GGUF's metadata as model_info (arrays null unless verbose) and, when verbose, its tensors."""
    from gpushare.catalog.gguf_reader import open_gguf

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
    async with admit(request, name):  # it reads the model's files: a tenant's flood of it is held to its limits
        return web.json_response(await _shown(request, name, verbose))


async def _shown(request: web.Request, name: str, verbose: bool) -> dict:
    registry = context(request).registry
    source = registry.find(name)
    desc = await registry.describe(source.name)
    preset = source.preset
    # Where the node keeps its files is the operator's business: other tenants see the file name only.
    path = source.path if is_admin(request) else os.path.basename(source.path)
    model_info, tensors = desc.model_info, []
    if source.format == "gguf":
        model_info, tensors = await off_loop(_gguf_info, source.path, verbose)
    adapter = source.adapter and (source.adapter if is_admin(request) else os.path.basename(source.adapter))
    try:
        modelfile = format_modelfile(source.base if adapter else path, preset, source.name, adapter)
    except ModelfileError as e:  # an Ollama-store preset our grammar cannot hold: say so, never a wrong file
        modelfile = f"# {e}\nFROM {os.path.basename(path)}\n"
    template = preset.template if preset.template is not None else desc.template or ""
    answer = {
        "modelfile": modelfile,
        "parameters": parameters_text(preset.options),
        "template": template,
        "system": preset.system or "", "license": preset.license or "",
        "details": desc.details, "model_info": model_info,
        "capabilities": desc.capabilities + (["thinking"] if desc.kind == "chat" and template_thinks(template)
                                             else []),
        "modified_at": rfc3339(source.modified_at()), "weights": await registry.weight_format(source.name),
        "kernel": registry.kernel(source.name),  # None until loaded: the worker picks it at load
    }
    if preset.messages:
        answer["messages"] = preset.messages
    if verbose:
        answer["tensors"] = tensors
    return answer


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
        base, preset, adapter = parsed.base, parsed.preset, parsed.adapter
    else:
        adapter = _uploaded_gguf(request, body, "adapters") if body.get("adapters") else field(body, "adapter",
                                                                                                 "string")
        if body.get("files"):  # Ollama's newer clients: the files were uploaded to /api/blobs first
            base, preset = _uploaded_gguf(request, body, "files"), _preset_from_body(body)
        else:
            base, preset = required_string(body, "from"), _preset_from_body(body)
    try:
        context(request).registry.create(name, base, preset, adapter)
    except RegistrationError as e:
        raise bad_request(str(e)) from None
    return web.json_response({"status": "success"})


def _uploaded_gguf(request: web.Request, body: dict, key: str) -> str:
    """The blob path of `files`' (or `adapters'`) one GGUF ({"name.gguf": "sha256:..."}); 400 naming what is
    wrong."""
    files = field(body, key, "object")
    ggufs = [(k, v) for k, v in files.items() if k.endswith(".gguf")]
    if len(ggufs) != 1 or len(files) != 1:
        raise bad_request(f'"{key}" must name one .gguf file: gpushare creates from a GGUF blob (a safetensors '
                          f'folder can be pulled, or named by path in "from" or "adapter")', param=key)
    try:
        path = blob_path(context(request).settings.models_dir, ggufs[0][1])
    except StoreError as e:
        raise bad_request(f"{key}: {ggufs[0][0]}: {e}", param=key) from None
    if not path.is_file():
        raise bad_request(f"{key}: {ggufs[0][0]}: blob {ggufs[0][1]} was not uploaded (POST /api/blobs/<digest>)",
                          param=key)
    return str(path)


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


def _details(registry, source) -> dict:
    desc = registry.cached_description(source)
    return desc.details if desc is not None else {"parent_model": "", "format": source.format, "family": "",
                                                  "families": None, "parameter_size": "", "quantization_level": ""}


async def tags(request: web.Request) -> web.Response:
    registry = context(request).registry
    sources = registry.sources()
    models = []
    for source in (sources[name] for name in sorted(visible(request, sources))):
        models.append({"name": source.name, "model": source.name, "modified_at": rfc3339(source.modified_at()),
                       "size": source.size_bytes(), "digest": source.digest(), "details": _details(registry, source),
                       "state": registry.state(source)})  # gpushare's: loaded, loading, warm or on disk
    # gpushare's: why a broken manifest or Modelfile is not listed (admins only: it names files)
    skipped = catalog_problems(context(request).settings) if is_admin(request) else []
    return web.json_response({"models": models, **({"skipped": skipped} if skipped else {})})


async def ps(request: web.Request) -> web.Response:
    ctx = context(request)
    engine_stats = ctx.node.stats()
    stats = engine_stats.models
    own = own_view(request)  # a tenant of a shared model sees its own requests and KV, not the others'
    models = []
    for entry in ctx.registry.loaded():
        if not visible(request, [entry.name]):
            continue
        s, requests = seen_model(stats.get(entry.name), entry.active, own)
        expires = entry.expires_at if entry.expires_at is not None else time.time() + FOREVER_S
        kv_bytes = s.kv_committed_bytes if s else 0
        # What it holds now: weights and its slabs of the KV pool (a tensor-parallel group's first rank
        # holds the most KV heads; its slabs times the ranks bound the group's).
        kv_bytes *= entry.device.world_size
        size = entry.weight_bytes + kv_bytes
        models.append({
            "name": entry.name, "model": entry.name, "size": size, "digest": entry.source.digest(),
            "details": _details(ctx.registry, entry.source), "expires_at": rfc3339(expires),
            "size_vram": size if entry.device.config.device.startswith("cuda") else 0,
            "weight_bytes": entry.weight_bytes, "kv_committed_bytes": kv_bytes, "kv_dtype": engine_stats.kv_dtype,
            "context_length": context_room(entry.device, entry.engine_name, entry.model.config.context_length,
                                           entry.source.preset.options.get("num_ctx")
                                           or ctx.settings.server.context_length),
            "trained_context_length": entry.model.config.context_length,
            "kv_blocks_used": s.blocks_used if s else 0, "kv_blocks_total": s.blocks_total if s else 0,
            "kv_block_size": s.block_size if s else 0, "running": s.running if s else 0,
            "queued": s.waiting if s else 0,
            "requests": requests,
            "keep_alive": entry.keep_alive_s, "device": entry.device_name, "worker_pid": entry.device.pid,
            "tensor_parallel": entry.device.world_size, "devices": getattr(entry.device, "members", [entry.device_name]),
            "device_healthy": ctx.supervisor.healthy(entry.device_name) if ctx.supervisor else True,
            "weights": entry.model.weights, "kernel": entry.model.kernel,
            "load_duration": int(entry.load_duration_s * 1e9), "warm_load": entry.warm_load, "pinned": entry.source.pinned,
            # gpushare's: a LoRA adapter's base (its own row: the base's weights and KV are counted there once)
            **({"base": entry.base.name} if entry.base is not None else {}),
        })
    # gpushare's: models on their way in ("queued" for memory, or "loading" with the fraction read so far),
    # apart from "models", which Ollama's clients read as the loaded ones
    loading = [{"name": job.source.name, "state": job.state, "load_progress": job.progress,
                "completed": job.done_bytes, "total": job.total_bytes,
                **({"requests": job.waiters} if own is None else {})}  # others' waiters are theirs
               for job in ctx.registry.loading() if visible(request, [job.source.name])]
    body = {"models": models, "loading": loading, "tenants": tenant_rows(request)}
    if is_admin(request):  # node-wide figures: the operator's, not every tenant's
        body["memory"] = memory_report(ctx).as_json()
    return web.json_response(body)


async def delete(request: web.Request) -> web.Response:
    body = await read_json_object(request)
    name = field(body, "model", "string") or required_string(body, "name")
    check_admin(request, "delete models")
    try:
        await context(request).registry.remove(name)
    except RegistrationError as e:
        raise bad_request(str(e)) from None
    return web.json_response({})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/api/show", show)
    app.router.add_post("/api/create", create)
    app.router.add_post("/api/copy", copy)
    app.router.add_get("/api/tags", tags)
    app.router.add_get("/api/ps", ps)
    app.router.add_delete("/api/delete", delete)
