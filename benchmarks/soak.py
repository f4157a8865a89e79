"""Soak: many streaming requests, a third dropped mid-stream, a tenth hostile; does anything leak?

Starts `gpushare serve` on a free loopback port (one model, tenants on), warms it up, notes the
daemon's RSS and the greedy answers to a few probe prompts, then sends `--requests` (1,000)
streaming chats, `--concurrency` (8) at a time, seeded:
- a third are dropped after a random number of chunks (the client closes the connection);
- a tenth are hostile (bad sampling values, keep_alive "nan" or "1ms", too many stop strings or
  messages, nested JSON, a foreign Origin, a browser's text/plain body) and must get a 4xx;
- the rest read their stream to the end.
Afterwards: no KV block may stay held, RSS (the daemon's and its workers', each time once the idle
model has given its KV slabs back) must be within `--rss-tolerance` (10%) of its value after warm-up, and every probe's greedy answer must equal the one before. Time-bounded by
`--deadline-s`; exit status 1 when a check fails.

    python benchmarks/soak.py                           # ~6 minutes on a 2-core CPU
    python benchmarks/soak.py --requests 200 --json-out soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tenants import parse_with_model, prompt_of, start_daemon  # noqa: E402

KEY = "soak-key"
ADMIN_KEY = "soak-admin-key"
START_TIMEOUT_S = 300
IDLE_RELEASE_WAIT_S = 60  # the engine gives an idle model's KV back after 30 s
PROBES = ["Why is the sky blue?", "Name three fruits.", "What is two plus two?"]
HOSTILE = [
    lambda body: ({**body, "repetition_penalty": 1e-40}, {}),
    lambda body: ({**body, "temperature": 1e30}, {}),
    lambda body: ({**body, "seed": 2 ** 70}, {}),
    lambda body: ({**body, "stop": [str(i) for i in range(1000)]}, {}),
    lambda body: ({**body, "messages": body["messages"] * 5000}, {}),
    lambda body: (body, {"Origin": "https://evil.example"}),
    lambda body: (body, {"Origin": "http://localhost:3000", "Content-Type": "text/plain"}),
    lambda body: ('{"model": "bench", "messages": ' + "[" * 100_000 + "]" * 100_000 + "}", {}),
]
HOSTILE_OLLAMA = [{"model": "bench", "keep_alive": "nan"}, {"model": "bench", "keep_alive": "1ms"}]


def daemon_config(args, port: int, models_dir: Path) -> dict:
    return {
        "server": {"host": f"127.0.0.1:{port}", "drain_timeout": "2s", "max_queued": 1024},
        "models": [{"name": "bench", "path": args.model_path, "preload": True, "keep_alive": -1}],
        "models_dir": str(models_dir),
        "engine": {"device": args.device, "max_num_seqs": args.concurrency},
        "memory": {"kv_budget": "512MiB", "max_loaded_models": 1},
        "tenants": [{"name": "soak", "api_keys": [KEY]}, {"name": "admin", "api_keys": [ADMIN_KEY], "admin": True}],
    }


def chat_body(i: int, tokens: int) -> dict:
    return {"model": "bench", "messages": [{"role": "user", "content": prompt_of(i)}], "max_tokens": tokens,
            "temperature": 0, "stream": True}


def tree_rss(pid: int) -> int:
    """RSS of the daemon and its engine workers (the model and the KV pool live in the workers)."""
    daemon = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [daemon, *daemon.children(recursive=True)])


async def idle_rss(session: aiohttp.ClientSession, base_url: str, pid: int) -> int:
    """``tree_rss`` once the idle model has given its KV slabs back (the engine does after 30 s idle):
    the prefix cache keeps finished prompts' blocks meanwhile, by design, and those pages would count."""
    deadline = time.monotonic() + IDLE_RELEASE_WAIT_S
    while time.monotonic() < deadline:
        async with session.get(base_url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as resp:
            text = await resp.text()
        committed = next((float(line.split()[-1]) for line in text.splitlines()
                          if line.startswith("gpushare_kv_pool_committed_bytes ")), None)
        if committed == 0:
            break
        await asyncio.sleep(1)
    return tree_rss(pid)


async def ps(session: aiohttp.ClientSession, base_url: str) -> dict:
    async with session.get(base_url + "/api/ps", headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as resp:
        return await resp.json()


async def greedy_answer(session: aiohttp.ClientSession, base_url: str, prompt: str) -> str:
    body = {"model": "bench", "messages": [{"role": "user", "content": prompt}], "max_tokens": 24, "temperature": 0}
    async with session.post(base_url + "/v1/chat/completions", json=body) as resp:
        return (await resp.json())["choices"][0]["message"]["content"]


async def one_request(session, base_url: str, i: int, rng: random.Random, args, counts: dict) -> None:
    body = chat_body(i, args.tokens)
    if rng.random() < 0.1:
        kind = rng.randrange(len(HOSTILE) + len(HOSTILE_OLLAMA))
        if kind >= len(HOSTILE):
            path, payload, headers = "/api/generate", HOSTILE_OLLAMA[kind - len(HOSTILE)], {}
        else:
            path, (payload, headers) = "/v1/chat/completions", HOSTILE[kind](body)
        data = payload if isinstance(payload, str) else json.dumps(payload)
        headers = {"Content-Type": "application/json", **headers}
        async with session.post(base_url + path, data=data, headers=headers) as resp:
            await resp.read()
            counts["hostile_4xx" if 400 <= resp.status < 500 else "hostile_other"] += 1
        return
    drop_after = rng.randint(1, args.tokens) if rng.random() < 1 / 3 else None
    async with session.post(base_url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            counts["failed"] += 1
            return
        chunks = 0
        async for line in resp.content:
            if line.startswith(b"data: {"):
                chunks += 1
                if b'"error"' in line:
                    counts["failed"] += 1
                    return
                if drop_after is not None and chunks >= drop_after:
                    resp.close()  # the client goes away mid-stream
                    counts["dropped"] += 1
                    return
        counts["completed"] += 1


async def run(args) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="gpushare-soak-"))
    (workdir / "models").mkdir()
    proc, base_url, log = start_daemon(lambda port, models_dir: daemon_config(args, port, models_dir), workdir)
    session = aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"},
                                    timeout=aiohttp.ClientTimeout(total=600))
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the daemon did not start:\n{log.read_text()[-3000:]}")
            try:
                if (await ps(session, base_url)).get("models"):
                    break
            except (aiohttp.ClientError, ValueError):
                pass
            await asyncio.sleep(0.5)
        rng = random.Random(args.seed)
        counts = dict.fromkeys(("completed", "dropped", "hostile_4xx", "hostile_other", "failed"), 0)
        warm = dict.fromkeys(counts, 0)
        for i in range(args.warmup):
            await one_request(session, base_url, -1 - i, rng, args, warm)
        probes_before = [await greedy_answer(session, base_url, p) for p in PROBES]
        rss_warm = await idle_rss(session, base_url, proc.pid)
        semaphore = asyncio.Semaphore(args.concurrency)
        started = time.monotonic()

        async def bounded(i: int) -> None:
            async with semaphore:
                if time.monotonic() - started < args.deadline_s:
                    await one_request(session, base_url, i, rng, args, counts)

        await asyncio.gather(*(bounded(i) for i in range(args.requests)))
        elapsed_s = time.monotonic() - started
        held = None
        for _ in range(60):  # cancelled requests free their blocks within an engine step
            held = sum(m["kv_blocks_used"] for m in (await ps(session, base_url))["models"])
            if held == 0:
                break
            await asyncio.sleep(0.5)
        rss_after = await idle_rss(session, base_url, proc.pid)
        probes_after = [await greedy_answer(session, base_url, p) for p in PROBES]
    finally:
        await session.close()
        proc.terminate()
        proc.wait(60)
        shutil.rmtree(workdir, ignore_errors=True)  # its config and the daemon's log (a failure quotes the log)
    rss_ratio = rss_after / rss_warm
    return {"config": vars(args), "counts": counts, "elapsed_s": elapsed_s, "kv_blocks_held_after": held,
            "rss_warm_bytes": rss_warm, "rss_after_bytes": rss_after, "rss_ratio": rss_ratio,
            "probes_exact": probes_before == probes_after,
            "passed": held == 0 and abs(rss_ratio - 1) <= args.rss_tolerance and probes_before == probes_after
            and counts["failed"] == 0 and counts["hostile_other"] == 0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", help="GGUF file or HF folder (default: the bundled SmolLM2-135M)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--tokens", type=int, default=16, help="max_tokens of each request")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--rss-tolerance", type=float, default=0.10)
    p.add_argument("--deadline-s", type=float, default=1800, help="stop sending new requests after this long")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", help="also write the result as JSON here")
    args = parse_with_model(p, argv)
    result = asyncio.run(run(args))
    c = result["counts"]
    print(f"{sum(c.values())} requests in {result['elapsed_s']:.0f}s: {c['completed']} completed, "
          f"{c['dropped']} dropped mid-stream, {c['hostile_4xx']} hostile refused with 4xx "
          f"({c['hostile_other']} otherwise), {c['failed']} failed")
    print(f"KV blocks held afterwards: {result['kv_blocks_held_after']}; RSS {result['rss_warm_bytes'] / 2**20:.0f} "
          f"-> {result['rss_after_bytes'] / 2**20:.0f} MiB ({(result['rss_ratio'] - 1) * 100:+.1f}%); "
          f"probe answers exact: {result['probes_exact']}; {'PASSED' if result['passed'] else 'FAILED'}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
