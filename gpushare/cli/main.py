"""The `gpushare` command: `serve` runs the daemon; the other verbs talk HTTP to it.

The daemon's address comes from GPUSHARE_HOST (else OLLAMA_HOST, as for ollama), default
127.0.0.1:11434; with GPUSHARE_API_KEY set, every verb sends it as `Authorization: Bearer`
(the daemon's tenants). `node ...` and `service install` come from their own modules.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from gpushare.cli.format import human_bytes, human_delta, parse_time, print_model_info, table
from gpushare.cli.http_client import ApiFailure, DaemonUnreachable, call, load_with_progress, pull_with_progress
from gpushare.cli.run import cmd_run
from gpushare.settings.settings import ConfigError
from gpushare.catalog.modelfile import ModelfileError, parse_modelfile


def cmd_serve(args) -> int:
    from gpushare.daemon import serve as daemon
    from gpushare.settings.settings import load_settings

    try:
        settings = load_settings(args.config, host=args.host)
        daemon.check_kv_dtype(settings)
        daemon.check_tensor_parallel(settings)
        daemon.check_isolation(settings)
    except ConfigError as e:
        print(f"gpushare serve: config error: {e}", file=sys.stderr)
        return 1
    return daemon.run(settings)


def print_tenants(data: dict, as_json: bool) -> None:
    """`ps --tenants`: the tenant rows this key may see (its own; all of them for an admin key)."""
    tenants = data.get("tenants", [])
    if as_json:
        print(json.dumps({"tenants": tenants}, indent=2))
        return
    rows = [[t["name"], human_bytes(t["kv_used_bytes"]), human_bytes(t["kv_reserved_bytes"]),
             "unlimited" if t["kv_limit_bytes"] is None else human_bytes(t["kv_limit_bytes"]),
             str(t["running"]), str(t["queued"]), str(t["computed_tokens"]), str(t["generated_tokens"]),
             str(t["prefix_hit_tokens"])] for t in tenants]
    print(table(rows, ["TENANT", "KV USED", "KV RESERVED", "KV LIMIT", "RUNNING", "QUEUED", "PROMPT TOKENS",
                       "GENERATED", "PREFIX HITS"]))


def cmd_ps(args) -> int:
    data = call("GET", "/api/ps")
    if args.tenants:
        print_tenants(data, args.json)
        return 0
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    rows, now = [], time.time()
    for m in data["models"]:
        until = parse_time(m["expires_at"]) - now
        if m.get("keep_alive", 0) < 0 or until > 100 * 365 * 86400:
            until_text = "Forever"
        elif until <= 0:
            until_text = "Stopping..."
        else:
            until_text = human_delta(until)
        processor = "100% GPU" if m["size_vram"] else "100% CPU"
        device = m.get("device", "") + ("" if m.get("device_healthy", True) else " (unhealthy)")
        if m.get("tensor_parallel", 1) > 1:
            device = f"TP={m['tensor_parallel']} {device}"
        weights = f"{m.get('weights', '')} {m.get('kernel', '')}".strip()
        rows.append([m["name"], m["digest"][:12], human_bytes(m["size"]), processor, str(m["context_length"]),
                     until_text, f"{m['kv_blocks_used']}/{m['kv_blocks_total']}", f"{m['running']}/{m['queued']}",
                     device, str(m.get("worker_pid") or ""), (m.get("details") or {}).get("kind", ""), weights,
                     m.get("base", "")])
    for m in data.get("loading", []):  # on their way in: queued for memory, or loading
        until_text = f"Loading {m['load_progress']:.0%}" if m["state"] == "loading" else "Waiting for memory"
        rows.append([m["name"], "", "", "", "", until_text, "", f"0/{m['requests']}", "", "", "", "", ""])
    # Ollama's columns first (PROCESSOR as `ollama ps` shows it), then gpushare's.
    print(table(rows, ["NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL", "KV BLOCKS", "RUN/QUEUED", "DEVICE",
                       "WORKER PID", "KIND", "WEIGHTS", "BASE"]))  # BASE: a LoRA adapter's, its SIZE its own
    for d in (data.get("memory") or {}).get("devices", []):  # an admin's view (tenants see no node figures)
        where = "host RAM" if d["memory"] == "host" else "GPU memory"
        print(f"{d['device']}: {where} {human_bytes(d['used_bytes'])} used, {human_bytes(d['free_bytes'])} free")
    return 0


def cmd_list(args) -> int:
    data = call("GET", "/api/tags")
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    now = time.time()
    # KIND (chat, embedding, rerank) once the daemon has read the model's files; "-" before.
    rows = [[m["name"], m["digest"][:12], human_bytes(m["size"]), human_delta(parse_time(m["modified_at"]) - now),
             (m.get("details") or {}).get("kind") or "-", m.get("state", "")] for m in data["models"]]
    print(table(rows, ["NAME", "ID", "SIZE", "MODIFIED", "KIND", "STATE"]))
    for problem in data.get("skipped", []):
        print(f"skipped: {problem}", file=sys.stderr)
    return 0


SHOW_PARTS = ("modelfile", "parameters", "template", "system", "license")


def cmd_show(args) -> int:
    data = call("POST", "/api/show", {"model": args.model, "verbose": bool(args.verbose)})
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    parts = [part for part in SHOW_PARTS if getattr(args, part)]
    if len(parts) > 1:
        raise ApiFailure(f"choose one of --{', --'.join(parts)}")
    if parts:
        text = data.get(parts[0], "")
        print(text if text.endswith("\n") or not text else text + "\n", end="")
        return 0
    print_model_info(data)
    return 0


def cmd_load(args) -> int:
    """Load through /api/load, drawing its streamed progress on stderr; stdout says `loaded MODEL`."""
    final = load_with_progress(args.model, args.keep_alive)
    seconds = f"{final.get('load_duration', 0) / 1e9:.2f}s"
    how = {"loaded": "was already loaded", "warm": f"loaded from the warm tier in {seconds}",
           "on disk": f"loaded from disk in {seconds}"}.get(final.get("from"), f"loaded in {seconds}")
    print(f"{args.model} {how}", file=sys.stderr)
    print(f"loaded {args.model}")
    return 0


def cmd_unload(args) -> int:
    loaded = {m["name"] for m in call("GET", "/api/ps")["models"]}
    for model in args.models:
        if model not in loaded and f"{model}:latest" not in loaded:
            raise ApiFailure(f'model "{model}" is not loaded')
        call("POST", "/api/generate", {"model": model, "keep_alive": 0, "stream": False})
    return 0


def cmd_create(args) -> int:
    """`--from PATH|MODEL`, or `-f Modelfile` (read here; FROM relative to the Modelfile's folder)."""
    if (args.source is None) == (args.file is None):
        raise ApiFailure("give either --from PATH or -f Modelfile")
    body = {"model": args.name, "stream": False}
    if args.file is not None:
        try:
            with open(args.file) as f:
                parsed = parse_modelfile(f.read(), args.file)
        except OSError as e:
            raise ApiFailure(f"cannot read {args.file}: {e.strerror}") from None
        except ModelfileError as e:
            raise ApiFailure(str(e)) from None
        folder = os.path.dirname(os.path.abspath(args.file))
        base = os.path.join(folder, os.path.expanduser(parsed.base))
        source = base if os.path.exists(base) else parsed.base
        if parsed.adapter is not None:  # relative to the Modelfile, as FROM is
            body["adapter"] = os.path.join(folder, os.path.expanduser(parsed.adapter))
        preset = parsed.preset
        body.update({k: v for k, v in (("parameters", preset.options), ("system", preset.system),
                                       ("template", preset.template), ("messages", preset.messages),
                                       ("license", preset.license)) if v})
    else:
        path = os.path.expanduser(args.source)
        source = os.path.abspath(path) if os.path.exists(path) else args.source
    call("POST", "/api/create", {**body, "from": source})
    print(f"created {args.name} from {source}")
    return 0


def cmd_cp(args) -> int:
    call("POST", "/api/copy", {"source": args.source, "destination": args.destination})
    print(f"copied '{args.source}' to '{args.destination}'")
    return 0


def cmd_pull(args) -> int:
    pull_with_progress(args.model, args.insecure)
    print(f"pulled {args.model}")
    return 0


def cmd_rm(args) -> int:
    for name in args.names:
        call("DELETE", "/api/delete", {"model": name})
        print(f"deleted '{name}'")
    return 0


# ---------------------------------------------------------------------------- parser

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpushare", description="Serve many language models from one shared engine per node. "
        "Verbs other than serve talk to the daemon at $GPUSHARE_HOST (default 127.0.0.1:11434), "
        "with $GPUSHARE_API_KEY as their API key when it is set.")
    from importlib.metadata import version

    parser.add_argument("--version", action="version", version=f"gpushare {version('gpushare')}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_serve_and_run(sub)
    _add_model_verbs(sub)
    _add_store_verbs(sub)
    _add_optional_verbs(sub)
    return parser


def _add_serve_and_run(sub) -> None:
    p = sub.add_parser("serve", help="run the daemon", description="Run the daemon: load the config, start the "
                       "engine and serve the Ollama (/api) and OpenAI (/v1) HTTP APIs until SIGINT/SIGTERM.")
    p.add_argument("--config", metavar="FILE", default=os.environ.get("GPUSHARE_CONFIG"),
                   help="YAML config (default $GPUSHARE_CONFIG, else built-in defaults: the bundled "
                   "smollm2:135m plus the models directory); every key is in configs/reference.yaml")
    p.add_argument("--host", metavar="HOST:PORT", help="address to listen on (overrides $GPUSHARE_HOST "
                   "and server.host; default 127.0.0.1:11434)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("run", help="chat with a model", description="Send PROMPT to MODEL and stream the "
                       "answer. With no PROMPT on a terminal, chat interactively as `ollama run` does (/? lists "
                       "the commands: /set, /show, /load, /save, /clear, /bye; \"\"\" for several lines; a "
                       "history file); piped stdin is read as (or appended to) the prompt.")
    p.add_argument("model", metavar="MODEL")
    p.add_argument("prompt", metavar="PROMPT", nargs="*", help="the prompt (words are joined by spaces)")
    p.add_argument("--keep-alive", "--keepalive", dest="keep_alive", metavar="DURATION", help="how long the model "
                   "stays loaded afterwards (e.g. 10m, 3600, -1 for ever, 0 to unload at once)")
    p.add_argument("--temperature", type=float, help="sampling temperature (0 = greedy)")
    p.add_argument("--seed", type=int, help="random seed, for reproducible sampling")
    p.add_argument("--max-tokens", type=int, help="most tokens to generate per answer")
    p.add_argument("--verbose", action="store_true", help="print timings after each answer (stderr)")
    p.add_argument("--format", choices=["json"], help="answer in JSON")
    p.set_defaults(func=cmd_run)


def _add_model_verbs(sub) -> None:
    """ps, list, show, load, unload: what is loaded and available, and moving models in and out."""
    p = sub.add_parser("ps", help="list loaded models", description="List the loaded models: size, device, "
                       "context, when they unload, KV-cache blocks in use and requests running/queued.")
    p.add_argument("--json", action="store_true", help="print the daemon's /api/ps answer as JSON")
    p.add_argument("--tenants", action="store_true", help="list tenants instead: KV used/reserved/limit, "
                   "requests running and queued, tokens served (your own row; every row for an admin key)")
    p.set_defaults(func=cmd_ps)

    p = sub.add_parser("list", aliases=["ls"], help="list available models",
                       description="List the models the daemon can serve (config and models directory).")
    p.add_argument("--json", action="store_true", help="print the daemon's /api/tags answer as JSON")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("show", help="show a model's details",
                       description="Show MODEL's architecture, size, context length and quantisation, or one "
                       "part of it: the Modelfile that rebuilds it, its parameters, template, system prompt or "
                       "license.")
    p.add_argument("model", metavar="MODEL")
    p.add_argument("--json", action="store_true", help="print the daemon's /api/show answer as JSON")
    for part in SHOW_PARTS:
        p.add_argument(f"--{part}", action="store_true", help=f"print only the model's {part}")
    p.add_argument("--verbose", "-v", action="store_true", help="with --json: every GGUF key and the tensors")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("load", help="load a model now", description="Load MODEL into the engine without "
                       "generating, and keep it for --keep-alive (default: the model's or server's keep_alive).")
    p.add_argument("model", metavar="MODEL")
    p.add_argument("--keep-alive", "--keepalive", dest="keep_alive", metavar="DURATION",
                   help="e.g. 10m, 3600 (seconds), -1 (for ever)")
    p.set_defaults(func=cmd_load)

    p = sub.add_parser("unload", aliases=["stop"], help="unload a model",
                       description="Unload each MODEL now (after its running requests finish) and free its "
                       "memory.")
    p.add_argument("models", metavar="MODEL", nargs="+")
    p.set_defaults(func=cmd_unload)


def _add_store_verbs(sub) -> None:
    """create, cp, rm: the names the models directory holds."""
    p = sub.add_parser("create", help="register a local model under a name",
                       description="Make PATH (a GGUF file, whatever its name, or a Hugging Face folder with "
                       "config.json and *.safetensors, or an existing model's name) available as NAME, by a link "
                       "in the daemon's models directory; or build NAME from an Ollama Modelfile (FROM, "
                       "PARAMETER, SYSTEM, TEMPLATE as Jinja, MESSAGE, LICENSE).")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--from", dest="source", metavar="PATH", help="GGUF file, HF folder or model")
    p.add_argument("-f", "--file", metavar="MODELFILE", help="an Ollama Modelfile")
    p.set_defaults(func=cmd_create)

    p = sub.add_parser("cp", help="copy a model under a new name",
                       description="Register SOURCE's weights and presets again as DESTINATION.")
    p.add_argument("source", metavar="SOURCE")
    p.add_argument("destination", metavar="DESTINATION")
    p.set_defaults(func=cmd_cp)

    p = sub.add_parser("pull", help="download a model from a registry",
                       description="Download MODEL into the daemon's models directory (a content-addressed store: "
                       "blobs shared between models, resumed after a cut) and make it available. MODEL is "
                       "name[:tag] (Ollama's library), namespace/name[:tag], host[:port]/namespace/name[:tag] "
                       "(that registry), or hf.co/USER/REPO[:QUANT] (Hugging Face: a GGUF quant, or a "
                       "safetensors repo; $HF_ENDPOINT and $HF_TOKEN as the daemon sees them).")
    p.add_argument("model", metavar="MODEL")
    p.add_argument("--insecure", action="store_true", help="allow plain HTTP to the registry")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("rm", help="remove models made by create or pull",
                       description="Unload each NAME and remove its link or Modelfile from the models directory "
                       "(the weights it points to are kept), or a pulled model's manifest and the blobs no "
                       "other model uses.")
    p.add_argument("names", metavar="NAME", nargs="+")
    p.set_defaults(func=cmd_rm)


def _add_optional_verbs(sub) -> None:
    """`node ...` and `service install`, when those modules are installed."""
    try:
        from gpushare.cli.node import add_node_parser
    except ImportError:
        pass
    else:
        add_node_parser(sub)
    try:
        from gpushare.service.install import add_service_parser
    except ImportError:
        pass
    else:
        add_service_parser(sub)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args) or 0
    except (DaemonUnreachable, ApiFailure, ConfigError) as e:
        print(f"Error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
