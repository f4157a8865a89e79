"""The `gpushare` command: `serve` runs the daemon; the other verbs talk HTTP to it.

The daemon's address comes from GPUSHARE_HOST (as OLLAMA_HOST for ollama), default
127.0.0.1:11434; with GPUSHARE_API_KEY set, every verb sends it as `Authorization: Bearer`
(the daemon's tenants). `node ...` and `service install` come from their own modules.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from gpushare.cli_format import ProgressBar, human_bytes, human_delta, keep_alive_value, parse_time, table
from gpushare.cli_http import ApiFailure, DaemonUnreachable, call, stream
from gpushare.config import ConfigError


def cmd_serve(args) -> int:
    from gpushare import daemon
    from gpushare.config import load_settings

    try:
        settings = load_settings(args.config, host=args.host)
        daemon.check_kv_dtype(settings)
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
        rows.append([m["name"], m["digest"][:12], human_bytes(m["size"]), processor, str(m["context_length"]),
                     until_text, f"{m['kv_blocks_used']}/{m['kv_blocks_total']}",
                     f"{m['running']}/{m['queued']}"])
    for m in data.get("loading", []):  # on their way in: queued for memory, or loading
        until_text = f"Loading {m['load_progress']:.0%}" if m["state"] == "loading" else "Waiting for memory"
        rows.append([m["name"], "", "", "", "", until_text, "", f"0/{m['requests']}"])
    print(table(rows, ["NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL", "KV BLOCKS", "RUN/QUEUED"]))
    return 0


def cmd_list(args) -> int:
    data = call("GET", "/api/tags")
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    now = time.time()
    rows = [[m["name"], m["digest"][:12], human_bytes(m["size"]), human_delta(parse_time(m["modified_at"]) - now),
             m.get("state", "")] for m in data["models"]]
    print(table(rows, ["NAME", "ID", "SIZE", "MODIFIED", "STATE"]))
    return 0


def cmd_show(args) -> int:
    data = call("POST", "/api/show", {"model": args.model})
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    info, details = data.get("model_info", {}), data.get("details", {})
    arch = info.get("general.architecture", "")
    lines = [("architecture", arch), ("parameters", details.get("parameter_size", "")),
             ("context length", info.get(f"{arch}.context_length", "")),
             ("embedding length", info.get(f"{arch}.embedding_length", "")),
             ("quantization", details.get("quantization_level", "")), ("format", details.get("format", ""))]
    print("  Model")
    for key, value in lines:
        if value != "":
            print(f"    {key:<20}{value}")
    print("\n  Capabilities")
    for cap in data.get("capabilities", []):
        print(f"    {cap}")
    source = next((ln[5:] for ln in data.get("modelfile", "").splitlines() if ln.startswith("FROM ")), None)
    if source:
        print(f"\n  Path\n    {source}")
    return 0


def cmd_load(args) -> int:
    """Load through /api/load, drawing its streamed progress on stderr; stdout says `loaded MODEL`."""
    body = {"model": args.model}
    if args.keep_alive is not None:
        body["keep_alive"] = keep_alive_value(args.keep_alive)
    bar, final = ProgressBar(f"loading {args.model}"), {}
    try:
        for line in stream("/api/load", body):
            if line.get("status") == "loading" and line.get("total"):
                bar.update(line["completed"], line["total"])
            elif line.get("status") == "queued" and not bar.tty:
                print(f"waiting for memory to load {args.model}", file=sys.stderr)
            final = line
    finally:
        bar.close()
    seconds = f"{final.get('load_duration', 0) / 1e9:.2f}s"
    how = {"loaded": "was already loaded", "warm": f"loaded from the warm tier in {seconds}",
           "on disk": f"loaded from disk in {seconds}"}.get(final.get("from"), f"loaded in {seconds}")
    print(f"{args.model} {how}", file=sys.stderr)
    print(f"loaded {args.model}")
    return 0


def cmd_unload(args) -> int:
    loaded = {m["name"] for m in call("GET", "/api/ps")["models"]}
    if args.model not in loaded and f"{args.model}:latest" not in loaded:
        raise ApiFailure(f'model "{args.model}" is not loaded')
    call("POST", "/api/generate", {"model": args.model, "keep_alive": 0, "stream": False})
    return 0


def cmd_create(args) -> int:
    source = os.path.abspath(os.path.expanduser(args.source)) if os.path.exists(os.path.expanduser(args.source)) \
        else args.source
    call("POST", "/api/create", {"model": args.name, "from": source, "stream": False})
    print(f"created {args.name} from {source}")
    return 0


def cmd_rm(args) -> int:
    call("DELETE", "/api/delete", {"model": args.name})
    print(f"deleted '{args.name}'")
    return 0


def _chat_once(args, messages: list[dict]) -> str:
    """Stream one answer to stdout; returns its text."""
    options = {k: v for k, v in (("temperature", args.temperature), ("seed", args.seed),
                                 ("num_predict", args.max_tokens)) if v is not None}
    body = {"model": args.model, "messages": messages, "options": options}
    if args.keep_alive is not None:
        body["keep_alive"] = keep_alive_value(args.keep_alive)
    parts, final = [], {}
    for chunk in stream("/api/chat", body):
        piece = chunk.get("message", {}).get("content", "")
        parts.append(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()
        if chunk.get("done"):
            final = chunk
    text = "".join(parts)
    if not text.endswith("\n"):
        sys.stdout.write("\n")
    if args.verbose and final:
        _print_stats(final)
    return text


def _print_stats(final: dict) -> None:
    """Ollama's `--verbose` summary, from the final chunk's nanosecond durations."""
    def seconds(key: str) -> float:
        return final[key] / 1e9

    def rate(count_key: str, duration_key: str) -> str:
        return f"{final[count_key] / seconds(duration_key):.2f} tokens/s" if final[duration_key] else "-"

    print(f"total duration:       {seconds('total_duration'):.3f}s\n"
          f"load duration:        {seconds('load_duration'):.3f}s\n"
          f"prompt eval count:    {final['prompt_eval_count']} token(s)\n"
          f"prompt eval duration: {seconds('prompt_eval_duration'):.3f}s\n"
          f"prompt eval rate:     {rate('prompt_eval_count', 'prompt_eval_duration')}\n"
          f"eval count:           {final['eval_count']} token(s)\n"
          f"eval duration:        {seconds('eval_duration'):.3f}s\n"
          f"eval rate:            {rate('eval_count', 'eval_duration')}", file=sys.stderr)


def cmd_run(args) -> int:
    prompt = " ".join(args.prompt)
    if not sys.stdin.isatty():
        piped = sys.stdin.read()
        if piped.strip():
            prompt = f"{prompt}\n\n{piped}" if prompt else piped
    elif not prompt:
        return _interactive(args)
    if not prompt.strip():
        raise ApiFailure("the prompt is empty")
    _chat_once(args, [{"role": "user", "content": prompt}])
    return 0


def _interactive(args) -> int:
    load = {"model": args.model, "stream": False}
    if args.keep_alive is not None:
        load["keep_alive"] = keep_alive_value(args.keep_alive)
    call("POST", "/api/generate", load)  # fail early (404) and pay the load before the first prompt
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    history: list[dict] = []
    print("Type /bye to exit, /clear to forget the conversation.", file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print("\nUse Ctrl + d or /bye to exit.")
            continue
        if line.strip() in ("/bye", "/exit"):
            return 0
        if line.strip() == "/clear":
            history.clear()
            print("Cleared the conversation.")
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        try:
            answer = _chat_once(args, history)
        except KeyboardInterrupt:  # closing the stream cancels the request in the daemon
            print()
            history.pop()
            continue
        history.append({"role": "assistant", "content": answer})


# ---------------------------------------------------------------------------- parser

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpushare", description="Serve many language models from one shared engine per node. "
        "Verbs other than serve talk to the daemon at $GPUSHARE_HOST (default 127.0.0.1:11434), "
        "with $GPUSHARE_API_KEY as their API key when it is set.")
    from importlib.metadata import version

    parser.add_argument("--version", action="version", version=f"gpushare {version('gpushare')}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("serve", help="run the daemon", description="Run the daemon: load the config, start the "
                       "engine and serve the Ollama (/api) and OpenAI (/v1) HTTP APIs until SIGINT/SIGTERM.")
    p.add_argument("--config", metavar="FILE", default=os.environ.get("GPUSHARE_CONFIG"),
                   help="YAML config (default $GPUSHARE_CONFIG, else built-in defaults: the bundled "
                   "smollm2:135m plus the models directory); every key is in configs/reference.yaml")
    p.add_argument("--host", metavar="HOST:PORT", help="address to listen on (overrides $GPUSHARE_HOST "
                   "and server.host; default 127.0.0.1:11434)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("run", help="chat with a model", description="Send PROMPT to MODEL and stream the "
                       "answer. With no PROMPT on a terminal, chat interactively (history kept; /bye exits, "
                       "/clear forgets); piped stdin is read as (or appended to) the prompt.")
    p.add_argument("model", metavar="MODEL")
    p.add_argument("prompt", metavar="PROMPT", nargs="*", help="the prompt (words are joined by spaces)")
    p.add_argument("--keep-alive", metavar="DURATION", help="how long the model stays loaded afterwards "
                   "(e.g. 10m, 3600, -1 for ever, 0 to unload at once)")
    p.add_argument("--temperature", type=float, help="sampling temperature (0 = greedy)")
    p.add_argument("--seed", type=int, help="random seed, for reproducible sampling")
    p.add_argument("--max-tokens", type=int, help="most tokens to generate per answer")
    p.add_argument("--verbose", action="store_true", help="print timings after each answer (stderr)")
    p.set_defaults(func=cmd_run)

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
                       description="Show MODEL's architecture, size, context length and quantisation.")
    p.add_argument("model", metavar="MODEL")
    p.add_argument("--json", action="store_true", help="print the daemon's /api/show answer as JSON")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("load", help="load a model now", description="Load MODEL into the engine without "
                       "generating, and keep it for --keep-alive (default: the model's or server's keep_alive).")
    p.add_argument("model", metavar="MODEL")
    p.add_argument("--keep-alive", metavar="DURATION", help="e.g. 10m, 3600 (seconds), -1 (for ever)")
    p.set_defaults(func=cmd_load)

    p = sub.add_parser("unload", aliases=["stop"], help="unload a model",
                       description="Unload MODEL now (after its running requests finish) and free its memory.")
    p.add_argument("model", metavar="MODEL")
    p.set_defaults(func=cmd_unload)

    p = sub.add_parser("create", help="register a local model under a name",
                       description="Make PATH (a .gguf file or a Hugging Face folder with config.json and "
                       "*.safetensors, or an existing model's name) available as NAME, by a link in the "
                       "daemon's models directory.")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--from", dest="source", metavar="PATH", required=True, help="GGUF file, HF folder or model")
    p.set_defaults(func=cmd_create)

    p = sub.add_parser("rm", help="remove a model made by create",
                       description="Unload NAME and remove its link from the models directory (the weights "
                       "it points to are kept).")
    p.add_argument("name", metavar="NAME")
    p.set_defaults(func=cmd_rm)

    _add_optional_verbs(sub)
    return parser


def _add_optional_verbs(sub) -> None:
    """`node ...` and `service install`, when those modules are installed."""
    try:
        from gpushare.node.commands import add_node_parser
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
