"""The ``daemon`` part of benchmarks/gpu_check.py: ``gpushare serve`` from this checkout (``python -m
gpushare.cli.main``, PYTHONPATH set: nothing pip-installed) with ``engine.device: cuda`` and a random
SmolLM2-135M preloaded; 16 concurrent ``/api/chat`` requests, each answered; ``/api/ps`` naming the
model's device (``cuda:0`` on a GPU); then SIGTERM, and the exit status and time it took."""

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from gpu_check_common import DEVICE, DRY, ROOT
from gpu_check_models import write_model

sys.path.insert(0, str(ROOT / "tests"))
from daemon_fixture import free_port, http, write_config  # noqa: E402 (the tests' own helpers)

MODEL = "smollm2-random"
CHATS = 16
CHAT_TOKENS = 64 if not DRY else 4
# inside the part's 60 s, so that a daemon that fails is reported with its log before the part is killed
SLOWER = 3 if DRY else 1
READY_TIMEOUT_S, CHAT_TIMEOUT_S, STOP_TIMEOUT_S = 35 * SLOWER, 15 * SLOWER, 8 * SLOWER


def chat(url, i, results):
    body = {"model": MODEL, "stream": False, "messages": [{"role": "user", "content": f"Tell me story {i}."}],
            "options": {"num_predict": CHAT_TOKENS, "temperature": 0}}
    start = time.perf_counter()
    try:
        status, answer, _ = http("POST", url + "/api/chat", body, timeout_s=CHAT_TIMEOUT_S)
    except OSError as e:  # a timeout or a dropped connection: this chat's failure
        status, answer = None, f"{type(e).__name__}: {e}"
    results[i] = (status, answer, time.perf_counter() - start)


def part_daemon(report):
    with tempfile.TemporaryDirectory(prefix="gpu-check-daemon-") as tmp:
        tmp = Path(tmp)
        folder = write_model("smollm2-135m", str(tmp / "model"), DRY, DEVICE)
        port = free_port()
        (tmp / "models").mkdir()
        config = write_config(tmp, port, folder, {
            "models": [{"name": MODEL, "path": folder, "preload": True}],
            "engine": {"device": DEVICE, "max_num_seqs": CHATS, "max_num_batched_tokens": 2048},
            "memory": {"kv_budget": "1GiB" if not DRY else "128MiB", "max_loaded_models": 1}})
        log_path = tmp / "daemon.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUSHARE_", "OLLAMA_"))}
        env.update(OLLAMA_MODELS=str(tmp / "no-ollama-store"), GPUSHARE_HISTORY=str(tmp / "history"),
                   PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
        url = f"http://127.0.0.1:{port}"
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "gpushare.cli.main", "serve", "--config", str(config)],
                                stdout=log_path.open("w"), stderr=subprocess.STDOUT, env=env, cwd=tmp)
        try:
            serve(report, proc, url, start)
        finally:
            stop(report, proc)
            log = log_path.read_text(errors="replace").splitlines()
            report.data["daemon_log_tail"] = log[-60:]
            if report.failures:
                report.line("  daemon log (last 30 lines):")
                for text in log[-30:]:
                    report.line("    | " + text)


def serve(report, proc, url, start):
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if http("GET", url + "/ready", timeout_s=5)[0] == 200:
                break
        except OSError:
            pass
        time.sleep(0.2)
    ready = proc.poll() is None and http("GET", url + "/ready", timeout_s=5)[0] == 200
    report.data["daemon_ready_s"] = time.perf_counter() - start
    report.line(f"  ready (model preloaded) after {report.data['daemon_ready_s']:.1f} s: {report.verdict(ready)}")
    if not ready:
        return

    results = {}
    threads = [threading.Thread(target=chat, args=(url, i, results)) for i in range(CHATS)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    answered = [r for r in results.values() if r[0] == 200 and isinstance(r[1], dict) and r[1].get("message")]
    tokens = sum(r[1].get("eval_count", 0) for r in answered)
    report.data["daemon_chats"] = {"sent": CHATS, "answered": len(answered), "tokens": tokens, "seconds": seconds}
    report.line(f"  {CHATS} concurrent chats: {len(answered)} answered, {tokens} tokens in {seconds:.2f} s "
                f"({tokens / seconds:.0f} tok/s) {report.verdict(len(answered) == CHATS)}")
    for status, answer, _ in [r for r in results.values() if r not in answered][:3]:
        report.line(f"    failed: {status} {str(answer)[:200]}")

    status, ps, _ = http("GET", url + "/api/ps")
    devices = [m.get("device") for m in ps.get("models", [])] if isinstance(ps, dict) else []
    expected = "cuda:0" if DEVICE == "cuda" else "cpu"
    report.data["api_ps"] = ps
    report.line(f"  /api/ps devices {devices} (expected {expected}): "
                f"{report.verdict(status == 200 and bool(devices) and all(str(d).startswith(expected) for d in devices))}")
    memory = ps.get("memory") if isinstance(ps, dict) else None
    if memory is not None:
        report.line(f"  /api/ps memory: {memory}")


def stop(report, proc):
    if proc.poll() is not None:
        report.line(f"  the daemon exited by itself with {proc.returncode} {report.verdict(False)}")
        return
    start = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
        report.line(f"  SIGTERM: still running after {STOP_TIMEOUT_S} s, killed {report.verdict(False)}")
        return
    report.data["daemon_stop"] = {"exit": code, "seconds": time.perf_counter() - start}
    report.line(f"  SIGTERM: exited {code} after {time.perf_counter() - start:.1f} s {report.verdict(code == 0)}")
