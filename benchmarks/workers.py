"""Engine worker processes: what the process boundary costs, and what a second device buys.

Starts `gpushare serve` on free loopback ports, one daemon at a time, and drives it with
benchmarks/serve.py's streaming load (greedy, ignore_eos, the same seeded workload each time):

1. overhead: one CPU device, engine.isolation `process` (the engine in a worker process, its
   outputs over a socket) against `thread` (the same engine as a thread of the daemon), at
   `--concurrency` (16); rounds alternate the two (`--rounds`, 2) so that drift hits both. Target:
   the process boundary costs < 2% of aggregate tok/s.
2. devices: two models under one load (each at half the concurrency, at once), served by
   engine.devices [cpu:0, cpu:1] with one model pinned to each, against one `cpu` device holding
   both. Aggregate tok/s of the two.

    python benchmarks/workers.py                     # both, ~6 minutes on a 2-core CPU
    python benchmarks/workers.py --only overhead --json-out workers.json

Run nothing else meanwhile: two torch processes on 2 cores slow each other 5-20x.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve import run_benchmark  # noqa: E402
from tenants import parse_with_model, start_daemon, stop_daemon, wait_until_ready  # noqa: E402

OVERHEAD_TARGET = 0.02


def daemon_config(port: int, models_dir: Path, args, engine: dict, models: list[dict]) -> dict:
    return {"server": {"host": f"127.0.0.1:{port}", "drain_timeout": "2s", "max_queued": 1024},
            "models": [{"path": args.model_path, "preload": True, "keep_alive": -1, **m} for m in models],
            "models_dir": str(models_dir),
            "engine": {"max_num_seqs": args.max_num_seqs, **engine},
            "memory": {"kv_budget": args.kv_budget, "max_loaded_models": 2}}


async def serve_load(base_url: str, models: list[str], concurrency: int, args) -> float:
    """Aggregate output tok/s of one streaming load per model, all at once."""
    runs = await asyncio.gather(*(
        run_benchmark(base_url, m, num_prompts=max(8, 2 * concurrency // len(models)), input_len=(32, 64),
                      output_len=(args.output_len, args.output_len), seed=args.seed + i,
                      concurrency=concurrency // len(models), progress=False, label=m)
        for i, m in enumerate(models)))
    for r in runs:
        if r["errors"]:
            raise RuntimeError(f"requests failed: {r['errors']}")
    return sum(r["metrics"]["output_throughput_tok_s"] for r in runs)


async def measure(args, engine: dict, models: list[dict], concurrency: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        proc, base_url, log = start_daemon(lambda port, models_dir: daemon_config(port, models_dir, args, engine,
                                                                                 models), Path(tmp))
        try:
            await wait_until_ready(proc, base_url, log, [m["name"] for m in models])
            return await serve_load(base_url, [m["name"] for m in models], concurrency, args)
        finally:
            stop_daemon(proc)


async def overhead(args) -> dict:
    tok_s: dict[str, list[float]] = {"thread": [], "process": []}
    for _ in range(args.rounds):
        for isolation in ("thread", "process"):
            tok_s[isolation].append(await measure(args, {"devices": ["cpu"], "isolation": isolation},
                                                  [{"name": "bench"}], args.concurrency))
    thread, process = statistics.mean(tok_s["thread"]), statistics.mean(tok_s["process"])
    return {"tok_s": tok_s, "thread_mean": thread, "process_mean": process, "overhead": 1 - process / thread}


async def devices(args) -> dict:
    two = [{"name": "a", "device": "cpu:0"}, {"name": "b", "device": "cpu:1"}]
    one = [{"name": "a"}, {"name": "b"}]
    return {"one_device": await measure(args, {"devices": ["cpu"]}, one, args.concurrency),
            "two_devices": await measure(args, {"devices": ["cpu:0", "cpu:1"]}, two, args.concurrency)}


def report(result: dict, args) -> str:
    lines = []
    if "overhead" in result:
        o = result["overhead"]
        verdict = "met" if o["overhead"] < OVERHEAD_TARGET else "MISSED"
        lines += [f"overhead at concurrency {args.concurrency}, one CPU device, {args.output_len} tokens each:",
                  f"  isolation thread : {', '.join(f'{x:.1f}' for x in o['tok_s']['thread'])} tok/s "
                  f"(mean {o['thread_mean']:.1f})",
                  f"  isolation process: {', '.join(f'{x:.1f}' for x in o['tok_s']['process'])} tok/s "
                  f"(mean {o['process_mean']:.1f})",
                  f"  process boundary costs {100 * o['overhead']:.1f}% of aggregate tok/s "
                  f"(target < {100 * OVERHEAD_TARGET:.0f}%: {verdict})"]
    if "devices" in result:
        d = result["devices"]
        lines += [f"two models, each at concurrency {args.concurrency // 2}, at once:",
                  f"  one device (cpu, both CPUs): {d['one_device']:.1f} tok/s",
                  f"  two devices (cpu:0, cpu:1) : {d['two_devices']:.1f} tok/s "
                  f"({d['two_devices'] / d['one_device']:.2f}x)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="GGUF file or HF folder (default: the bundled SmolLM2-135M)")
    p.add_argument("--only", choices=["overhead", "devices"])
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-budget", default="1GiB")
    p.add_argument("--json-out")
    args = parse_with_model(p, argv)
    result = {}
    if args.only in (None, "overhead"):
        result["overhead"] = asyncio.run(overhead(args))
    if args.only in (None, "devices"):
        result["devices"] = asyncio.run(devices(args))
    print(report(result, args))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"config": vars(args), **result}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
