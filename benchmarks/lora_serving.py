"""LoRA serving (issue 39): 16 adapters served on one base against the base alone and against 16 merged models.

    .venv/bin/python benchmarks/lora_serving.py                 # the full run
    .venv/bin/python benchmarks/lora_serving.py --quick         # smoke run: 2 adapters, 2 streams, 1 round of 16 tokens
    .venv/bin/python benchmarks/lora_serving.py --prepare-only  # only make (or find) the adapters and merged models

Step 1 makes `--adapters` (16) seeded PEFT LoRA adapters for SmolLM2-135M-Instruct (the bundled Q4_1 GGUF,
dequantized by transformers): r=16, lora_alpha=32, on all seven targets q,k,v,o,gate,up,down
(`--targets all`) or on q and v (`--targets qv`, PEFT's default for Llama), random A and B
(`init_lora_weights=False`) with B scaled so that each target's update is DELTA_RATIO of its base
weight (larger updates turn a 135M model's answers to noise). Each adapter is saved as a PEFT folder and,
merged into the base (`merge_and_unload`), as a safetensors folder with the tokenizer and config. Both
stay under --work-dir, so a rerun skips making them (delete it after changing the recipe).

Step 2 runs three daemons one after another (never two at once), each `gpushare serve` on 127.0.0.1 with
a fresh XDG_CACHE_HOME (the C++ kernels built and the kernel verdict measured as on a fresh machine) and
the default config but for its models and memory.max_loaded_models (room for all of them, see
daemon_config): (a) the base alone, every stream asking it; (b) the base plus the adapters as models
(`{"name", "adapter", "base"}` entries), stream i asking adapter i; (c) the merged folders as models,
stream i asking merged model i. One stream per adapter, all at once, each sending `--rounds` greedy
streaming chats of 96 tokens one after another (ignore_eos, so every answer is 96 tokens long; the same
seeded prompts in every way). After a warm-up round (which loads every model) the daemon's RSS and PSS
with its worker processes (memory.py) and /api/ps (the weights format and kernel each model is served
in) are read; then the measured rounds give output tok/s and TTFT p50/p99.

Step 3 prints a markdown table, the ratios (b)/(a) (goal: tok/s at least 0.8x) and (b)/(c), and the
machine facts every figure in docs/benchmarks.md states (CPU, SIMD flags, kernels, weights formats).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import shutil
import sys
import time

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from latency_stats import RequestTimeline, compute_metrics  # noqa: E402
from memory import MiB, get_json, resident_bytes  # noqa: E402
from systems import (MODEL_NAME, ROOT, ServerProcess, find_gguf, free_port, git_info, machine_info,  # noqa: E402
                     serving_formats, versions)
from serve import run_benchmark  # noqa: E402

from gpushare.protocol.weight_format import WEIGHT_FORMATS  # noqa: E402

RANK, ALPHA = 16, 32
TARGET_SETS = {"all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
               "qv": ["q_proj", "v_proj"]}  # qv: what PEFT's LoraConfig targets on a Llama by default
DELTA_RATIO = 0.05  # |B A| * alpha / r over |W| per target: answers differ from the base's and stay fluent
INPUT_WORDS = (32, 64)  # prompt length, as memory.py's bursts
START_TIMEOUT_S = 900  # a fresh cache builds the C++ kernels and measures their verdict first
WARMUP_SEED, MEASURED_SEED = 1000, 0  # the warm-up's prompts are not the measured ones (no prefix-cache hits)


def adapter_dir(work_dir: str, targets: str, i: int) -> str:
    return os.path.join(work_dir, f"adapter-{targets}-{i:02d}")


def merged_dir(work_dir: str, targets: str, i: int) -> str:
    return os.path.join(work_dir, f"merged-{targets}-{i:02d}")


def scale_updates(peft_model) -> None:
    """Scale each target's lora_B so that its update alpha / r * B A is DELTA_RATIO of the base weight:
    PEFT's random init (nn.Linear's for both halves) makes updates as large as the weights themselves."""
    import torch
    from peft.tuners.lora import LoraLayer

    with torch.no_grad():
        for module in peft_model.modules():
            if isinstance(module, LoraLayer):
                a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
                update = module.scaling["default"] * (b @ a)
                b.mul_(DELTA_RATIO * module.get_base_layer().weight.norm() / update.norm())


def make_models(gguf: str, work_dir: str, targets: str, count: int, seed: int) -> None:
    """The adapters and merged models of step 1 that --work-dir does not hold yet. Each is written under a
    .tmp name and renamed when complete, so a run stopped midway leaves nothing that a rerun would take."""
    missing = [i for i in range(count) if not (os.path.isdir(adapter_dir(work_dir, targets, i))
                                               and os.path.isdir(merged_dir(work_dir, targets, i)))]
    if not missing:
        return
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.makedirs(work_dir, exist_ok=True)
    folder, name = os.path.split(gguf)
    print(f"making adapters {missing} in {work_dir}", file=sys.stderr, flush=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    dequantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # A plain model of the same (dense) weights: save_pretrained refuses a model that carries its GGUF
    # quantizer, and config.json must not say "gguf".
    del dequantized.config.quantization_config
    base = AutoModelForCausalLM.from_config(dequantized.config, dtype=torch.float32)
    base.load_state_dict(dequantized.state_dict())
    del dequantized
    for i in missing:
        torch.manual_seed(seed + i)
        # a copy per adapter: get_peft_model wraps the model's linears and merge_and_unload overwrites them
        model = get_peft_model(copy.deepcopy(base), LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGET_SETS[targets],
                                                               init_lora_weights=False))
        scale_updates(model)
        adapter_tmp = adapter_dir(work_dir, targets, i) + ".tmp"
        merged_tmp = merged_dir(work_dir, targets, i) + ".tmp"
        model.save_pretrained(adapter_tmp)
        merged = model.merge_and_unload()
        merged.save_pretrained(merged_tmp)
        tokenizer.save_pretrained(merged_tmp)
        finals = merged_dir(work_dir, targets, i), adapter_dir(work_dir, targets, i)
        for tmp, final in zip((merged_tmp, adapter_tmp), finals):
            shutil.rmtree(final, ignore_errors=True)  # the half of a pair a stopped run renamed already
            os.replace(tmp, final)
        print(f"  adapter {i}: {adapter_dir(work_dir, targets, i)}, merged {merged_dir(work_dir, targets, i)}",
              file=sys.stderr)


def model_entries(way: str, gguf: str, work_dir: str, targets: str, count: int,
                  merged_weights: str | None) -> list[dict]:
    """config `models[]` of a way: the base alone (a), the base and the adapters (b), the merged models (c)."""
    base = {"name": MODEL_NAME, "path": gguf}
    if way == "a":
        return [base]
    if way == "b":
        return [base] + [{"name": f"ad{i}", "adapter": adapter_dir(work_dir, targets, i), "base": MODEL_NAME}
                         for i in range(count)]
    weights = {"weights": merged_weights} if merged_weights else {}
    return [{"name": f"merged{i}", "path": merged_dir(work_dir, targets, i), **weights} for i in range(count)]


def stream_models(way: str, count: int) -> list[str]:
    """The model stream i asks: every stream the base in (a), its own adapter or merged model otherwise."""
    return [MODEL_NAME if way == "a" else f"{'ad' if way == 'b' else 'merged'}{i}" for i in range(count)]


def daemon_config(port: int, run_dir: str, entries: list[dict]) -> dict:
    """The default config but for the models (and an empty models directory, no Ollama store: only they
    are served) and memory.max_loaded_models: the default 4 would have the daemon swap the merged models
    (and, if adapters count as models, the adapters) in and out instead of holding them side by side."""
    return {"server": {"host": f"127.0.0.1:{port}"}, "models": entries,
            "models_dir": os.path.join(run_dir, "models"), "ollama_models": [],
            "memory": {"max_loaded_models": len(entries) + 1}}


async def drive(url: str, models: list[str], rounds: int, output_tokens: int, seed: int) -> tuple[dict, list[str]]:
    """One closed-loop stream per entry of `models`, all at once, stream i sending `rounds` greedy chats of
    `output_tokens` to models[i] one after another (seeded prompts of its own); metrics over all requests."""
    t0 = time.perf_counter()
    results = await asyncio.gather(*(
        run_benchmark(url, model, num_prompts=rounds, concurrency=1, input_len=INPUT_WORDS,
                      output_len=(output_tokens, output_tokens), seed=seed + i, warmup=False, progress=False,
                      include_requests=True)
        for i, model in enumerate(models)))
    duration_s = time.perf_counter() - t0
    # Each run_benchmark times from its own start; a request's TTFT is a difference within one of them.
    # Its requests keep no end_s (the usage chunk): the last output chunk stands for it.
    timelines = [RequestTimeline(start_s=r["start_s"], chunk_times_s=r["chunk_times_s"],
                                 end_s=(r["chunk_times_s"] or [r["start_s"]])[-1], output_tokens=r["output_tokens"],
                                 prompt_tokens=r["prompt_tokens"], success=r["success"], error=r["error"])
                 for res in results for r in res["requests"]]
    errors = sorted({e for res in results for e in res["errors"]})
    return compute_metrics(timelines, duration_s), errors


def measure_way(way: str, args, gguf: str, run_dir: str) -> dict:
    """Start way's daemon, warm it up, read its memory and /api/ps, run the measured rounds, stop it."""
    way_dir = os.path.join(run_dir, way)
    os.makedirs(os.path.join(way_dir, "cache"), exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    entries = model_entries(way, gguf, args.work_dir, args.targets, args.adapters, args.merged_weights)
    config_path = os.path.join(way_dir, "gpushare.yaml")
    with open(config_path, "w") as f:
        yaml.safe_dump(daemon_config(port, way_dir, entries), f)
    env = dict(os.environ, XDG_CACHE_HOME=os.path.join(way_dir, "cache"))
    daemon = ServerProcess(f"gpushare ({way})", [os.path.join(ROOT, ".venv", "bin", "gpushare"), "serve",
                                                 "--config", config_path],
                           url + "/", os.path.join(way_dir, "daemon.log"), env)
    models = stream_models(way, args.adapters)
    print(f"({way}) {len(set(models))} model(s), {len(models)} streams; log {daemon.log_path}", file=sys.stderr,
          flush=True)
    row: dict = {"way": way, "models": sorted(set(models))}
    try:
        daemon.start(timeout_s=START_TIMEOUT_S)
        _, errors = asyncio.run(drive(url, models, 1, 8, WARMUP_SEED))  # loads every model
        if errors:
            raise RuntimeError(f"the warm-up failed: {errors}")
        time.sleep(2)  # the last answers' buffers freed before RSS is read
        row["rss_bytes"], row["pss_bytes"] = resident_bytes(daemon)
        ps = get_json(url + "/api/ps")
        row["loaded"] = sorted(m["name"] for m in ps["models"])
        row["memory"] = ps.get("memory")
        row["serving"] = serving_formats(url)
        metrics, errors = asyncio.run(drive(url, models, args.rounds, args.tokens, MEASURED_SEED))
        want = len(models) * args.rounds * args.tokens
        if errors or metrics["total_output_tokens"] != want:
            raise RuntimeError(f"{metrics['total_output_tokens']} tokens of {want}; errors: {errors}")
        row["metrics"] = metrics
        print(f"    {metrics['output_throughput_tok_s']:.1f} tok/s, TTFT p50 {metrics['ttft_ms']['p50']:.0f} ms, "
              f"RSS {row['rss_bytes'] / MiB:.0f} MiB", file=sys.stderr, flush=True)
    except (RuntimeError, OSError) as exc:  # one way's failure (a daemon without adapter entries) keeps the others
        row["error"] = str(exc)
        print(f"    ({way}) failed: {exc}", file=sys.stderr, flush=True)
    finally:
        daemon.stop()
    return row


def formats_of(row: dict) -> str:
    """The distinct 'weights (kernel)' of the way's loaded models, from /api/ps."""
    models = (row.get("serving") or {}).get("models") or {}
    return ", ".join(sorted({f"{m['weights']} ({m['kernel']})" for m in models.values()})) or "n/a"


def report(rows: dict, args, machine: dict) -> str:
    """Step 3: the markdown table, the ratios and the machine facts."""
    labels = {"a": "(a) base alone", "b": f"(b) base + {args.adapters} adapters",
              "c": f"(c) {args.adapters} merged models"}
    lines = [f"{args.adapters} streams at once, {args.rounds} rounds of {args.tokens} greedy tokens each; adapters "
             f"r={RANK} on {','.join(TARGET_SETS[args.targets])}", "",
             "| way | tok/s | TTFT p50 ms | TTFT p99 ms | RSS MiB | PSS MiB | loaded | weights (kernel) |",
             "|---|---|---|---|---|---|---|---|"]
    for way, row in rows.items():
        if "metrics" not in row:
            why = row.get("error", "?").splitlines()[0][:200].replace("|", "/")  # one table cell
            lines.append(f"| {labels[way]} | failed: {why} | | | | | | |")
            continue
        m = row["metrics"]
        lines.append(f"| {labels[way]} | {m['output_throughput_tok_s']:.1f} | {m['ttft_ms']['p50']:.0f} | "
                     f"{m['ttft_ms']['p99']:.0f} | {row['rss_bytes'] / MiB:.0f} | {row['pss_bytes'] / MiB:.0f} | "
                     f"{len(row['loaded'])} | {formats_of(row)} |")

    def ratio(num: str, den: str, key) -> str:
        if "metrics" not in rows.get(num, {}) or "metrics" not in rows.get(den, {}):
            return "n/a"
        return f"{key(rows[num]) / key(rows[den]):.2f}x"

    def tok_s(row: dict) -> float:
        return row["metrics"]["output_throughput_tok_s"]

    lines += ["", f"(b)/(a): tok/s {ratio('b', 'a', tok_s)} (goal >= 0.8x), "
                  f"RSS {ratio('b', 'a', lambda r: r['rss_bytes'])}, PSS {ratio('b', 'a', lambda r: r['pss_bytes'])}",
              f"(b)/(c): tok/s {ratio('b', 'c', tok_s)}, RSS {ratio('b', 'c', lambda r: r['rss_bytes'])}, "
              f"PSS {ratio('b', 'c', lambda r: r['pss_bytes'])}"]
    for way, row in rows.items():
        if row.get("memory"):
            lines.append(f"{labels[way]}, /api/ps memory (MiB): " + ", ".join(
                f"{k.removesuffix('_bytes')} {v / MiB:.0f}" for k, v in row["memory"].items()))
    serving = next((r["serving"] for r in rows.values() if "kernels" in (r.get("serving") or {})), {})
    kernels = serving.get("kernels") or {}
    lines.append(f"machine: {machine['cpu_model']}, {machine['physical_cores']} cores, flags "
                 f"{' '.join(serving.get('cpu_flags') or []) or 'n/a'}; kernels: ISA {kernels.get('isa')}, "
                 f"block kernel {kernels.get('block_kernel')}; GPUSHARE_ env {serving.get('env') or 'none'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 adapters, 2 streams, 1 round of 16 tokens")
    p.add_argument("--prepare-only", action="store_true", help="step 1 only: make the adapters and merged models")
    p.add_argument("--adapters", type=int, default=16, help="adapters, merged models and streams (default 16)")
    p.add_argument("--rounds", type=int, default=4, help="chats each stream sends one after another (default 4)")
    p.add_argument("--tokens", type=int, default=96, help="output tokens of each chat (default 96)")
    p.add_argument("--seed", type=int, default=0, help="adapter i is made with seed SEED + i")
    p.add_argument("--targets", default="all", choices=sorted(TARGET_SETS),
                   help="the adapters' target modules: all seven (default) or q and v (PEFT's default)")
    p.add_argument("--ways", default="abc", help="which of (a), (b), (c) to run (default abc)")
    p.add_argument("--merged-weights", default=None, choices=WEIGHT_FORMATS,
                   help="models[].weights of the merged models (default: the daemon's auto, float32 for a "
                        "dense folder on the CPU; int4 serves them in the base's format)")
    p.add_argument("--work-dir", default=os.path.join(ROOT, "benchmarks", "results", "lora_work"),
                   help="where the adapters and merged models are kept between runs, and each run's logs")
    p.add_argument("--json-out", default=None, help="write every figure here")
    args = p.parse_args(argv)
    if set(args.ways) - set("abc"):
        p.error(f"--ways: letters a, b, c only, got {args.ways!r}")
    if args.quick:
        args.adapters, args.rounds, args.tokens = 2, 1, 16
    gguf = find_gguf()
    make_models(gguf, args.work_dir, args.targets, args.adapters, args.seed)
    if args.prepare_only:
        return 0
    run_dir = os.path.join(args.work_dir, "runs", time.strftime("%Y%m%d-%H%M%S"))
    rows = {way: measure_way(way, args, gguf, run_dir) for way in "abc" if way in args.ways}
    machine = machine_info()
    print(report(rows, args, machine))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "settings": vars(args), "machine": machine,
                       "versions": versions(), "git": git_info(ROOT), "ways": rows}, f, indent=1)
    return 0 if all("metrics" in r for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
