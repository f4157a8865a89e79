"""The device check for a lent GPU machine, in one command, each part with its own timeout:

    PYTHONPATH=. python3 benchmarks/gpu_check.py            # or: make gpu-check

from the repository root of a machine with the NVIDIA driver, PyTorch with CUDA and Triton, and no
network; nothing pip-installed (gpushare is this checkout), no GGUF (gpu_check_models.py writes
random-weight models of real layer shapes; SmolLM2's tokenizer is in benchmarks/data/). Missing
packages: benchmarks/README-gpu-check.md. Every part runs in a process of its own under its timeout;
one that fails or hangs is recorded (a hung one is killed with its process group) and the next
runs. Everything lands in ONE results file, ``$OUT/gpu_check.json`` (``--out``; default
benchmarks/results/gpu_check/), rewritten after each part, and a summary is printed.

    PYTHONPATH=. python3 benchmarks/gpu_check.py --device cpu   # the dry run: every part's code on
                                                               # tiny shapes, Triton interpreted
    python3 benchmarks/gpu_check.py --fixtures RESULTS.json DIR  # the node probes as fixture files

Parts, timeouts and expected costs on one H100 (no GPU was at hand when this was written, so the
costs are estimates: shapes over the card's ~3 TB/s and ~800 TFLOP/s that the lending machine's own
notes record, Triton compiles at ~1 s each on a cold cache, and the CPU host's Python for the rest):

| part         | what                                                             | expect | timeout |
|--------------|------------------------------------------------------------------|--------|---------|
| env          | versions, the card, which dependencies import, nvidia-smi         | ~6 s   | 15 s    |
| node         | read-only NVML / MIG / MPS probes kept as recorded outputs       | ~8 s   | 20 s    |
| kernels      | copy and bf16-matmul peaks; paged attention (6 shapes x 6 checks, | ~50 s  | 75 s    |
|              | ~40 compiles) vs torch; decode GB/s, prefill TFLOP/s, cache write |        |         |
| quant        | int8/int4 matmuls vs torch (24 checks), tile sweep (30 compiles), | ~45 s  | 60 s    |
|              | timed at M=1/16/64/512 on 3 Llama-3-8B weights (<= ~1 ms a call) |        |         |
| lora         | the LoRA kernel vs torch in bf16 and fp32, timed; the engine with | ~18 s  | 30 s    |
|              | 8 random adapters + base rows at c=16 (base rows must not change) |        |         |
| sampling     | the batched sampler at batch 64 x 49,152: seeds, penalties, syncs | ~8 s   | 20 s    |
| llm_bfloat16 | LLM on SmolLM2-135M (random weights) at c=1/16/64, 128 tokens:    | ~25 s  | 40 s    |
| llm_int8     | each ~3 s to write and load, warm-up compiles (~5-15 s), ~6 s     | ~20 s  | 40 s    |
| llm_int4     | timed (~10 ms a step), a seeded check; int4 also one profile      | ~22 s  | 40 s    |
| llm_big      | 2 layers of Llama-3-8B (bf16, int4) and Gemma-2-9B (bf16), c=16:  | ~40 s  | 60 s    |
|              | 1.1-1.7 GB written, read back as float32 and moved, per model    |        |         |
| daemon       | gpushare serve on cuda, 16 concurrent chats, /api/ps, SIGTERM     | ~30 s  | 60 s    |

The timeouts sum to 460 s (7 min 40 s), so the whole check ends within 8 minutes even when every
part runs to its limit (a part's timeout includes the 3 s that killing it may take); the expected
total is ~4.5 minutes. Each part's time includes its process start (~3 s: torch, CUDA).
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# name -> (module, function, timeout_s on a GPU)
PARTS = {
    "env": ("gpu_check_node", "part_env", 15),
    "node": ("gpu_check_node", "part_node", 20),
    "kernels": ("gpu_check_attention", "part_kernels", 75),
    "quant": ("gpu_quant_check", "part_quant_matmul", 60),
    "lora": ("gpu_check_lora_sampling", "part_lora", 30),
    "sampling": ("gpu_check_lora_sampling", "part_sampling", 20),
    "llm_bfloat16": ("gpu_check_llm", "part_llm_bfloat16", 40),
    "llm_int8": ("gpu_check_llm", "part_llm_int8", 40),
    "llm_int4": ("gpu_check_llm", "part_llm_int4", 40),
    "llm_big": ("gpu_check_llm", "part_llm_big", 60),
    "daemon": ("gpu_check_daemon", "part_daemon", 60),
}
DRY_TIMEOUT_FACTOR = 3  # the dry run's tiny shapes run interpreted on a loaded CPU
LOG_TAIL_LINES = 80
KILL_GRACE_S = 3  # of a part's timeout: SIGTERM to its process group, then SIGKILL


def run_part(name: str, out_path: str) -> int:
    """In the part's own process: run it, save its report (also when it raised)."""
    import importlib

    sys.path[:0] = [str(ROOT), str(HERE)]
    from gpu_check_common import Report

    module, function, _ = PARTS[name]
    report = Report()
    try:
        getattr(importlib.import_module(module), function)(report)
        return 0
    except Exception:
        for text in traceback.format_exc().rstrip().splitlines():
            report.line(f"  ! {text}")
        report.data["exception"] = traceback.format_exc().rstrip().splitlines()[-1]
        return 1
    finally:
        report.save(out_path)


def child_env(device: str) -> dict:
    env = dict(os.environ, GPU_CHECK_DEVICE=device, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    return env


def launch(name: str, device: str, timeout_s: float, workdir: Path) -> dict:
    """Run one part in a new process group under ``timeout_s``; what it reported, its status and log tail."""
    out_path, log_path = workdir / f"{name}.json", workdir / f"{name}.log"
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--run-part", name, str(out_path)],
                                stdout=log, stderr=subprocess.STDOUT, env=child_env(device), cwd=ROOT,
                                start_new_session=True)
        try:
            code = proc.wait(max(timeout_s - KILL_GRACE_S, 0.1))
            status = "ok" if code == 0 else f"error (exit {code})"
        except subprocess.TimeoutExpired:
            status = f"timeout after {timeout_s:g} s"
        kill_group(proc)  # also what an ended part left behind in its group
    part = {"status": status, "seconds": round(time.perf_counter() - start, 1), "timeout_s": timeout_s}
    if out_path.exists():
        part.update(json.loads(out_path.read_text()))
    log_lines = log_path.read_text(errors="replace").splitlines()
    if part["status"] != "ok" or "lines" not in part:
        part["log_tail"] = log_lines[-LOG_TAIL_LINES:]
    if part["status"] == "ok" and part.get("failures"):
        part["status"] = f"{part['failures']} check(s) failed"
    return part


def kill_group(proc):
    """The part and whatever it started (a daemon, its workers): SIGTERM, then SIGKILL."""
    for sig, wait_s in ((signal.SIGTERM, KILL_GRACE_S - 1), (signal.SIGKILL, 1)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def summary(results: dict) -> list[str]:
    lines = ["", "== summary"]
    for name, part in results["parts"].items():
        lines.append(f"  {name:9s} {part['status']:28s} {part['seconds']:6.1f} s of {part['timeout_s']:.0f}")
    total = sum(p["seconds"] for p in results["parts"].values())
    lines.append(f"  total {total:.0f} s; results: {results['path']}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cuda (a lent GPU) or cpu (the dry run: tiny shapes, Triton interpreted)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, from {', '.join(PARTS)}")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(HERE / "results" / "gpu_check"),
                        help="folder for gpu_check.json (default: $OUT, else benchmarks/results/gpu_check)")
    parser.add_argument("--timeout", action="append", default=[], metavar="PART=SECONDS",
                        help="another timeout for a part (repeatable), e.g. llm=200")
    parser.add_argument("--run-part", nargs=2, metavar=("NAME", "JSON"), help=argparse.SUPPRESS)
    parser.add_argument("--fixtures", nargs=2, metavar=("RESULTS", "DIR"),
                        help="write the node part's recorded outputs of RESULTS (a gpu_check.json) into DIR")
    args = parser.parse_args(argv)
    if args.run_part:
        return run_part(*args.run_part)
    if args.fixtures:
        return write_fixtures(*args.fixtures)

    names = [n.strip() for n in args.parts.split(",") if n.strip()]
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {unknown}: choose from {', '.join(PARTS)}")
    factor = DRY_TIMEOUT_FACTOR if args.device == "cpu" else 1
    timeouts = {name: PARTS[name][2] * factor for name in names}
    for item in args.timeout:
        name, _, seconds = item.partition("=")
        if name not in timeouts:
            parser.error(f"--timeout {item}: {name!r} is not one of the parts run")
        timeouts[name] = float(seconds)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gpu_check.json")
    results = {"device": args.device, "path": path, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "parts": {}}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as workdir:
        for name in names:
            timeout_s = timeouts[name]
            print(f"== {name} (timeout {timeout_s} s)", flush=True)
            part = launch(name, args.device, timeout_s, Path(workdir))
            results["parts"][name] = part
            for text in part.get("lines", []) + part.get("log_tail", []):
                print(text, flush=True)
            print(f"  -> {part['status']} in {part['seconds']} s", flush=True)
            with open(path + ".tmp", "w") as f:  # whole after each part: a run cut short keeps what it did
                json.dump(results, f, indent=1, default=str)
            os.replace(path + ".tmp", path)
    for text in summary(results):
        print(text, flush=True)
    return 0 if all(p["status"] == "ok" for p in results["parts"].values()) else 1


def write_fixtures(results_path: str, folder: str) -> int:
    """The node part's recorded outputs as files (tests/fixtures/node/nvidia's shape)."""
    recorded = json.loads(Path(results_path).read_text())["parts"].get("node", {}).get("data", {}).get("recorded", {})
    os.makedirs(folder, exist_ok=True)
    for name, text in recorded.items():
        Path(folder, name).write_text(text if text.endswith("\n") else text + "\n")
        print(os.path.join(folder, name))
    return 0 if recorded else 1


if __name__ == "__main__":
    sys.exit(main())
