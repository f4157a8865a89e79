"""Serving benchmark for any OpenAI-compatible server (gpushare, llama-server, Ollama, vLLM).

Streams `POST /v1/chat/completions` (SSE, `stream_options.include_usage`) with aiohttp,
records when each chunk arrives and reports TTFT, TPOT, ITL, throughput and goodput
(see latency_stats.py for the definitions, which are vLLM's).

Workload: `--num-prompts` chat prompts of seeded random common words (a word is about
one token in BPE vocabularies; the real prompt token counts come from the server's
usage) with output lengths drawn uniformly from `--output-len`. `max_tokens` is sent,
and `ignore_eos` (on by default; honoured by gpushare, llama.cpp and vLLM) makes the
outputs as long as asked. Arrivals: all at once under a `--concurrency` cap (closed
loop), Poisson at `--rate` req/s, or gamma-distributed gaps with `--burstiness` < 1
(burstier) or > 1 (more regular), as in vLLM.

    python benchmarks/serve.py --base-url http://127.0.0.1:11434 --model smollm2:135m \
        --concurrency 8 --num-prompts 64 --json-out out.json

Other scripts: `await run_benchmark(base_url, model, ...)` returns the same dict.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time

import aiohttp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from latency_stats import RequestTimeline, compute_metrics, format_table  # noqa: E402

# Short common English words: each is a single token (with its leading space) in
# GPT-2-style vocabularies, so a prompt of N words is close to N tokens.
WORDS = (
    "the of and to in is was for on that with as by at from his her are this had not but "
    "have they which one you were all she there would their we him been has when who will "
    "more no if out so said what up its about into than them can only other new some time "
    "could these two may then do first any my now such like our over man me even most made "
    "after also did many before must through back years where much your way well down should "
    "because each just those people how too little state good very make world still own see "
    "men work long get here between both life being under never day same another know while "
    "last might us great old year off come since against go came right used take three"
).split()


class BenchmarkError(RuntimeError):
    """The benchmark cannot run at all (server unreachable, model unknown, ...)."""


def parse_range(text: str) -> tuple[int, int]:
    """'64' -> (64, 64); '32:128' -> (32, 128)."""
    lo, _, hi = text.partition(":")
    lo_i, hi_i = int(lo), int(hi or lo)
    if not 1 <= lo_i <= hi_i:
        raise ValueError(f"bad length range {text!r}: want MIN:MAX with 1 <= MIN <= MAX")
    return lo_i, hi_i


def make_workload(num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int],
                  seed: int) -> list[tuple[str, int]]:
    """Seeded (prompt text, max_tokens) pairs; the same seed gives the same workload."""
    rng = np.random.default_rng(seed)
    workload = []
    for _ in range(num_prompts):
        n_words = int(rng.integers(input_len[0], input_len[1] + 1))
        words = rng.choice(len(WORDS), size=n_words)
        prompt = "Continue this text: " + " ".join(WORDS[i] for i in words)
        workload.append((prompt, int(rng.integers(output_len[0], output_len[1] + 1))))
    return workload


def arrival_offsets_s(num_requests: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send time of each request after the start. The first goes at 0; gaps are
    gamma(shape=burstiness, mean=1/rate), which is Poisson for burstiness 1."""
    if math.isinf(rate):
        return [0.0] * num_requests
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be positive")
    rng = np.random.default_rng(seed + 1)  # not the workload's stream: rate must not change prompts
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=max(num_requests - 1, 0))
    return [0.0] + np.cumsum(gaps).tolist()


def chat_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    return base + "/chat/completions"


async def stream_one(session: aiohttp.ClientSession, url: str, body: dict) -> RequestTimeline:
    """Send one streaming chat (or plain) completion and time its chunks."""
    tl = RequestTimeline(start_s=time.perf_counter())
    content_chunks = 0
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                text = (await resp.text())[:300]
                tl.end_s, tl.success, tl.error = time.perf_counter(), False, f"HTTP {resp.status}: {text}"
                return tl
            async for raw in resp.content:
                line = raw.strip()
                if not line or line.startswith(b":"):  # SSE keep-alive comments
                    continue
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                now = time.perf_counter()
                data = json.loads(payload)
                if "error" in data:
                    raise RuntimeError(f"server error in stream: {data['error']}")
                choices = data.get("choices") or []
                delta = choices[0].get("delta", {}) if choices else {}
                # The role-only opening chunk carries no token: it must not count as TTFT.
                # /v1/completions streams `text` where chat streams a delta.
                if delta.get("content") or delta.get("reasoning_content") or (choices and choices[0].get("text")):
                    tl.chunk_times_s.append(now)
                    content_chunks += 1
                if usage := data.get("usage"):
                    tl.output_tokens = int(usage.get("completion_tokens") or 0)
                    tl.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                tl.end_s = now
        if not tl.output_tokens:  # server without usage in the stream: one token per chunk
            tl.output_tokens = content_chunks
        if not tl.chunk_times_s:
            tl.success, tl.error = False, "stream ended without any output"
    except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, ValueError) as exc:
        tl.end_s, tl.success, tl.error = time.perf_counter(), False, f"{type(exc).__name__}: {exc}"
    return tl


class Progress:
    """One status line on stderr: rewritten in place on a terminal, every 10% otherwise."""

    def __init__(self, total: int, label: str, enabled: bool):
        self.total, self.label, self.enabled = total, label, enabled
        self.done = self.failed = 0
        self.start_s = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.last_tenth = -1

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        if not self.enabled:
            return
        tenth = self.done * 10 // max(self.total, 1)
        if not self.tty and tenth == self.last_tenth and self.done != self.total:
            return
        self.last_tenth = tenth
        msg = (f"{self.label} {self.done}/{self.total} requests"
               f"{f', {self.failed} failed' if self.failed else ''}, {time.perf_counter() - self.start_s:.1f}s")
        end = "" if self.tty and self.done < self.total else "\n"
        print(("\r\033[K" if self.tty else "") + msg, end=end, file=sys.stderr, flush=True)


async def run_benchmark(
    base_url: str,
    model: str,
    *,
    num_prompts: int = 64,
    input_len: tuple[int, int] = (32, 128),
    output_len: tuple[int, int] = (32, 128),
    seed: int = 0,
    rate: float = math.inf,
    burstiness: float = 1.0,
    concurrency: int | None = None,
    ignore_eos: bool = True,
    temperature: float = 0.0,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    warmup: bool = True,
    request_timeout_s: float = 600.0,
    progress: bool = True,
    label: str = "",
    include_requests: bool = False,
) -> dict:
    """Run one benchmark; returns {"config", "metrics", "errors"[, "requests"]}.

    Raises BenchmarkError when the server cannot be reached or refuses the warm-up
    request (wrong model name, wrong path), so a sweep stops at once instead of
    recording a run of failures.
    """
    url = chat_url(base_url)
    workload = make_workload(num_prompts, input_len, output_len, seed)
    offsets = arrival_offsets_s(num_prompts, rate, burstiness, seed)

    def body(prompt: str, max_tokens: int) -> dict:
        b = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
             "temperature": temperature, "stream": True, "stream_options": {"include_usage": True}}
        if ignore_eos:
            b["ignore_eos"] = True
        return b

    # force_close: llama-server drops kept-alive connections after a streamed response,
    # and a reused dead connection would show up as a spurious failure. limit=0: the
    # connector must not cap concurrency below what was asked.
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=10)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        if warmup:
            tl = await stream_one(session, url, body(workload[0][0], 4))
            if not tl.success:
                raise BenchmarkError(f"warm-up request to {url} (model {model!r}) failed: {tl.error}")

        limit = asyncio.Semaphore(concurrency) if concurrency else None
        bar = Progress(num_prompts, label or f"[serve {base_url}]", progress)

        async def one(offset_s: float, prompt: str, max_tokens: int) -> RequestTimeline:
            await asyncio.sleep(max(0.0, t0 + offset_s - time.perf_counter()))
            if limit is None:
                tl = await stream_one(session, url, body(prompt, max_tokens))
            else:
                async with limit:
                    tl = await stream_one(session, url, body(prompt, max_tokens))
            bar.update(tl.success)
            return tl

        t0 = time.perf_counter()
        timelines = await asyncio.gather(*(one(off, p, n) for off, (p, n) in zip(offsets, workload)))
        duration_s = time.perf_counter() - t0

    metrics = compute_metrics(timelines, duration_s, slo_ttft_ms, slo_tpot_ms)
    result = {
        "config": {"base_url": base_url, "model": model, "num_prompts": num_prompts, "input_len": list(input_len),
                   "output_len": list(output_len), "seed": seed, "rate": None if math.isinf(rate) else rate,
                   "burstiness": burstiness, "concurrency": concurrency, "ignore_eos": ignore_eos,
                   "temperature": temperature},
        "metrics": metrics,
        "errors": sorted({t.error for t in timelines if t.error})[:10],
    }
    if include_requests:
        result["requests"] = [
            {"max_tokens": n, "prompt_tokens": t.prompt_tokens, "output_tokens": t.output_tokens,
             "success": t.success, "error": t.error,
             "start_s": t.start_s - t0, "chunk_times_s": [c - t0 for c in t.chunk_times_s]}
            for t, (_, n) in zip(timelines, workload)]
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:11434 (with or without /v1)")
    p.add_argument("--model", required=True)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=parse_range, default=(32, 128), help="prompt words, N or MIN:MAX")
    p.add_argument("--output-len", type=parse_range, default=(32, 128), help="max_tokens, N or MIN:MAX")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate", type=float, default=math.inf, help="requests/s (default: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson")
    p.add_argument("--concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--json-out", default=None, help="write the result (with per-request timelines) here")
    args = p.parse_args(argv)
    try:
        result = asyncio.run(run_benchmark(
            args.base_url, args.model, num_prompts=args.num_prompts, input_len=args.input_len,
            output_len=args.output_len, seed=args.seed, rate=args.rate, burstiness=args.burstiness,
            concurrency=args.concurrency, ignore_eos=args.ignore_eos, temperature=args.temperature,
            slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, warmup=args.warmup,
            request_timeout_s=args.request_timeout_s, include_requests=args.json_out is not None))
    except BenchmarkError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(format_table(result["metrics"], "Serving Benchmark Result"))
    for err in result["errors"]:
        print(f"error seen: {err}", file=sys.stderr)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
