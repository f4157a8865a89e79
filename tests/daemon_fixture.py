"""A live `gpushare serve` on a free loopback port, for the integration tests.

The daemon runs as the installed console script (.venv/bin/gpushare) with a YAML config
written to a temp dir, serving the bundled SmolLM2-135M GGUF (preloaded). Test modules
build a module-scoped fixture with `with serving(...) as daemon: yield daemon`; the
offline oracle is conftest's session-scoped `llm`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from http.client import HTTPConnection
from pathlib import Path
from typing import Iterator

import yaml

GPUSHARE = Path(sys.executable).parent / "gpushare"
MODEL = "smollm2:135m"
START_TIMEOUT_S = 180  # a loaded 2-core machine needs ~15 s to load the model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body=None, timeout_s: float = 120,
         headers: dict | None = None) -> tuple[int, dict | str, dict]:
    """(status, parsed JSON or text, headers) without raising on HTTP errors."""
    data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            status, raw, headers = resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as e:
        status, raw, headers = e.code, e.read(), dict(e.headers)
    try:
        return status, json.loads(raw), headers
    except ValueError:
        return status, raw.decode(), headers


@dataclass
class Daemon:
    url: str
    host: str  # HOST:PORT, as GPUSHARE_HOST takes it
    proc: subprocess.Popen
    log_path: Path
    models_dir: Path

    def log(self) -> str:
        return self.log_path.read_text()

    def env(self) -> dict:
        """Environment for CLI subprocesses that talk to this daemon."""
        return {**os.environ, "GPUSHARE_HOST": self.host, "GPUSHARE_HISTORY": str(self.log_path.parent / "history")}

    def loaded(self) -> dict[str, dict]:
        return {m["name"]: m for m in http("GET", self.url + "/api/ps")[1]["models"]}

    def wait_ready(self) -> None:
        """Wait until the daemon is ready (preloads done); fail with its log if it does not."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gpushare serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if http("GET", self.url + "/ready", timeout_s=5)[0] == 200:
                    return
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.1)  # a daemon is ready ~5 s after its start: poll finely (~40 starts a suite)
        self.stop()
        raise RuntimeError(f"gpushare serve did not load {MODEL} within {START_TIMEOUT_S}s:\n{self.log()}")

    def stop(self, timeout_s: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def write_config(tmp: Path, port: int, model_path: str, overrides: dict | None = None) -> Path:
    config = {
        "server": {"host": f"127.0.0.1:{port}", "drain_timeout": "5s"},
        "models": [{"name": MODEL, "path": model_path, "preload": True}],
        "models_dir": str(tmp / "models"),
        "engine": {"max_num_seqs": 4, "max_num_batched_tokens": 512},
        "memory": {"kv_budget": "256MiB", "max_loaded_models": 2},
    }
    for section, values in (overrides or {}).items():
        config[section] = {**config.get(section, {}), **values} if isinstance(values, dict) else values
    path = tmp / "gpushare.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def spawn_daemon(tmp: Path, model_path: str, overrides: dict | None = None, env: dict | None = None) -> Daemon:
    """Start `gpushare serve` for `model_path` (as smollm2:135m) with its config in tmp/gpushare.yaml;
    `env` adds to the environment (which keeps none of our GPUSHARE_ or OLLAMA_ variables); see
    Daemon.wait_ready. Without OLLAMA_MODELS in `env` no Ollama store is read (the machine's own stays out)."""
    port = free_port()
    (tmp / "models").mkdir(exist_ok=True)
    config = write_config(tmp, port, model_path, overrides)
    log_path = tmp / "daemon.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUSHARE_", "OLLAMA_"))} | \
        {"OLLAMA_MODELS": str(tmp / "no-ollama-store")} | (env or {})
    proc = subprocess.Popen([str(GPUSHARE), "serve", "--config", str(config)], stdout=log_path.open("w"),
                            stderr=subprocess.STDOUT, env=env)
    return Daemon(f"http://127.0.0.1:{port}", f"127.0.0.1:{port}", proc, log_path, tmp / "models")


@contextmanager
def serving(tmp: Path, model_path: str, overrides: dict | None = None, while_loading=None,
            env: dict | None = None) -> Iterator[Daemon]:
    """A ready daemon, stopped on leaving; ``while_loading()`` runs while it loads its model."""
    daemon = spawn_daemon(tmp, model_path, overrides, env)
    try:
        if while_loading is not None:
            while_loading()
        daemon.wait_ready()
        yield daemon
    finally:
        daemon.stop()


def long_stream(daemon: Daemon, key: str | None = None, wait_for_first_token: bool = True) -> HTTPConnection:
    """A streamed /v1/completions that runs until the caller closes it. Its length is guaranteed, not
    left to the model: greedy with `ignore_eos` for 2,000 tokens (minutes on a CPU, and more than any
    test holds it on a GPU), so no early end of sequence can finish it. With `wait_for_first_token`,
    its first token has been read: it is running, not queued."""
    conn = HTTPConnection("127.0.0.1", int(daemon.host.split(":")[1]), timeout=120)
    body = {"model": MODEL, "prompt": "Tell me a long story.", "temperature": 0, "max_tokens": 2000,
            "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Authorization": f"Bearer {key}"} if key else {})
    if wait_for_first_token:
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        while not (line := resp.readline()).startswith(b"data: "):
            assert line, "the stream ended before its first token"
    return conn


def wait_for(predicate, timeout_s: float = 10, interval_s: float = 0.1):
    """Poll until predicate() is truthy; returns its last value."""
    deadline = time.monotonic() + timeout_s
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(interval_s)
        value = predicate()
    return value
