"""Embedding benchmark (issue 37): embeddings per second for short inputs on any server with OpenAI's
`POST /v1/embeddings` (gpushare, `llama-server --embedding`), and a chat stream's inter-token latency
alone and while a flood of inputs is embedded beside it on the same server.

    python benchmarks/embeddings.py --base-url http://127.0.0.1:11434 --model all-minilm \
        --inputs 1000 --batch 32 --concurrency 4 \
        --chat-model smollm2:135m --flood 4000 --json-out out.json

Run it once per server (same GGUF, same machine, same run) and compare `embeddings_per_s`; the ITL
part needs a server that serves a chat model beside the embedding model (gpushare does). The issue's
goal: the chat stream's ITL p99 with the flood within 1.5x of its ITL p99 alone. The flood is one
request, as in the issue: give gpushare `limits.max_embed_inputs` (and `max_embed_tokens`) room for it.
`--through` adds a stream that runs through a whole flood, from its send to its answer's arrival (the
stream above ends before the flood does): what a user's chat sees while someone embeds 4,000 inputs.
The ratio varies from sitting to sitting on a 2-core machine: `--sittings N` measures it N times,
and also pools the sittings' gaps (alone, beside) into one p99 each: one stream's p99 is its second
longest gap of 127, which one hiccup of the machine sets (alone it moved from 13 to 20 ms here).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from latency_stats import percentile  # noqa: E402
from serve import WORDS, run_benchmark  # noqa: E402


def short_inputs(count: int, words: int = 12, seed: int = 0) -> list[str]:
    """Seeded texts of ``words`` common words (short, as search queries and chunks' titles are)."""
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(count)]


async def embed_all(session: aiohttp.ClientSession, url: str, model: str, texts: list[str], batch: int,
                    concurrency: int) -> float:
    """Seconds to embed ``texts`` in requests of ``batch`` inputs, ``concurrency`` at a time."""
    limit = asyncio.Semaphore(concurrency)

    async def one(chunk: list[str]) -> None:
        async with limit, session.post(url, json={"model": model, "input": chunk}) as resp:
            body = await resp.json()
            if resp.status != 200 or len(body.get("data", [])) != len(chunk):
                raise RuntimeError(f"{url}: HTTP {resp.status}: {str(body)[:300]}")

    start_s = time.perf_counter()
    await asyncio.gather(*(one(texts[i:i + batch]) for i in range(0, len(texts), batch)))
    return time.perf_counter() - start_s


async def chat_gaps_s(base_url: str, model: str, output_tokens: int) -> list[float]:
    """One chat stream's gaps between its chunks, in seconds."""
    result = await run_benchmark(base_url, model, num_prompts=1, output_len=(output_tokens, output_tokens),
                                 include_requests=True, progress=False, warmup=False)
    request = result["requests"][0]
    if not request["success"]:
        raise RuntimeError(f"the chat stream failed: {request['error']}")
    return [b - a for a, b in zip(request["chunk_times_s"], request["chunk_times_s"][1:])]


async def itl_beside_flood(session: aiohttp.ClientSession, args, seed: int) -> dict:
    """One sitting of the issue's figure: a chat stream's ITL p99 alone, then that of a stream sent with
    one request of ``args.flood`` inputs (the stream ends long before the flood does)."""
    url = args.base_url.rstrip("/") + "/v1/embeddings"
    alone = await chat_gaps_s(args.base_url, args.chat_model, args.output_tokens)
    flood = asyncio.ensure_future(embed_all(session, url, args.model, short_inputs(args.flood, seed=seed),
                                            args.flood, 1))  # one request of them all, as the issue
    beside = await chat_gaps_s(args.base_url, args.chat_model, args.output_tokens)
    done = flood.done()  # false: the whole stream ran beside the flood
    alone_p99, beside_p99 = percentile(alone, 99) * 1e3, percentile(beside, 99) * 1e3
    return {"chat_itl_p99_ms_alone": alone_p99, "chat_itl_p99_ms_beside_flood": beside_p99,
            "ratio": beside_p99 / alone_p99, "flood_done": done, "flood_seconds": await flood,
            "gaps_s": {"alone": alone, "beside": beside}}


async def stream_gaps(session: aiohttp.ClientSession, base_url: str, model: str, stop: asyncio.Event,
                      gaps: list[tuple[float, float, bool]]) -> None:
    """Greedy chat streams of 256 tokens (a chat's length, so its context stays short), one after another
    until ``stop`` is set: (time, gap in seconds, whether it opens a stream) of each token after the first, a
    stream's first token counted from the previous stream's last (a stall between two streams is a gap too)."""
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me a very long story."}], "stream": True,
            "max_tokens": 256, "temperature": 0, "ignore_eos": True}
    last = None
    while not stop.is_set():
        async with session.post(base_url.rstrip("/") + "/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"the chat stream failed: HTTP {resp.status}: {(await resp.text())[:300]}")
            first = True
            async for line in resp.content:
                if stop.is_set():
                    return
                if not line.startswith(b"data: {"):
                    continue
                now = time.perf_counter()
                if last is not None:
                    gaps.append((now, now - last, first))
                last, first = now, False


async def itl_through_flood(session: aiohttp.ClientSession, args) -> dict:
    """Chat streams' gaps for 10 s alone, then while one request of ``args.flood`` inputs is embedded, from
    its send to its whole answer's arrival (a 4,000-vector answer is ~31 MB of JSON): p50, p99, longest."""
    gaps: list[tuple[float, float, bool]] = []
    stop = asyncio.Event()
    chat = asyncio.ensure_future(stream_gaps(session, args.base_url, args.chat_model, stop, gaps))
    await asyncio.sleep(10.0)
    url = args.base_url.rstrip("/") + "/v1/embeddings"
    start_s = time.perf_counter()
    async with session.post(url, json={"model": args.model, "input": short_inputs(args.flood, seed=2)}) as resp:
        body = await resp.read()  # parsed after the streams stop: the client's own parse is not the server's
    end_s = time.perf_counter()
    await asyncio.sleep(0.5)
    stop.set()
    await chat
    count = len(json.loads(body).get("data", [])) if resp.status == 200 else 0
    if count != args.flood:
        raise RuntimeError(f"the flood failed: HTTP {resp.status}: {body[:300]!r}")
    alone = [gap for at, gap, _ in gaps if at <= start_s]
    during = [gap for at, gap, _ in gaps if start_s < at <= end_s + 0.5]
    opening = [(gap, at <= start_s) for at, gap, first in gaps if first and at <= end_s + 0.5]
    return {"flood_seconds": end_s - start_s, "gaps_alone": len(alone), "gaps": len(during),
            # a stream's first token after the previous stream's last (its request's send and prefill)
            "opening_alone_p50_ms": percentile([g for g, before in opening if before] or [0.0], 50) * 1e3,
            "opening_during_p50_ms": percentile([g for g, before in opening if not before] or [0.0], 50) * 1e3,
            "alone_p50_ms": percentile(alone, 50) * 1e3, "alone_p99_ms": percentile(alone, 99) * 1e3,
            "itl_p50_ms": percentile(during, 50) * 1e3, "itl_p99_ms": percentile(during, 99) * 1e3,
            "itl_max_ms": max(during) * 1e3,
            # (ms, seconds after the flood's send, whether the gap opened a stream)
            "longest": [(round(gap * 1e3, 1), round(at - start_s, 2), first)
                        for gap, at, first in sorted((g, a, f) for a, g, f in gaps if start_s < a <= end_s + 0.5)[-5:]]}


async def run(args) -> dict:
    url = args.base_url.rstrip("/") + "/v1/embeddings"
    texts = short_inputs(args.inputs)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await embed_all(session, url, args.model, texts[:args.batch], args.batch, 1)  # warm-up (and load)
        seconds = await embed_all(session, url, args.model, texts, args.batch, args.concurrency)
        out = {"base_url": args.base_url, "model": args.model, "inputs": args.inputs, "batch": args.batch,
               "concurrency": args.concurrency, "seconds": seconds, "embeddings_per_s": args.inputs / seconds}
        if args.chat_model:
            out["sittings"] = [await itl_beside_flood(session, args, seed=1 + i) for i in range(args.sittings)]
            ratios = [s["ratio"] for s in out["sittings"]]
            out["ratios"] = ratios
            out["goal_met"] = f"{sum(r <= 1.5 for r in ratios)} of {len(ratios)} sittings"
            gaps = [s.pop("gaps_s") for s in out["sittings"]]  # pooled below, not printed
            pooled = {side: [g for sitting in gaps for g in sitting[side]] for side in ("alone", "beside")}
            out["pooled"] = {f"{side}_p{q}_ms": percentile(side_gaps, q) * 1e3 for side, side_gaps in pooled.items()
                             for q in (50, 99)}
            out["pooled"]["ratio_p99"] = out["pooled"]["beside_p99_ms"] / out["pooled"]["alone_p99_ms"]
            if args.through:
                out["through_flood"] = await itl_through_flood(session, args)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", required=True, help="the embedding model's name on that server")
    p.add_argument("--inputs", type=int, default=1000, help="short inputs to embed (default 1000)")
    p.add_argument("--batch", type=int, default=32, help="inputs per request (default 32)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
    p.add_argument("--chat-model", help="also measure this chat model's ITL alone and beside a flood")
    p.add_argument("--flood", type=int, default=4000, help="inputs of the flood, in one request (default 4000)")
    p.add_argument("--output-tokens", type=int, default=128, help="the chat stream's length (default 128)")
    p.add_argument("--sittings", type=int, default=1,
                   help="times to measure the stream alone and beside a flood (the goal is 1.5x; default 1)")
    p.add_argument("--through", action="store_true",
                   help="also a chat stream that runs through a whole flood, its answer's arrival included")
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    result = asyncio.run(run(args))
    print(json.dumps(result, indent=2))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
