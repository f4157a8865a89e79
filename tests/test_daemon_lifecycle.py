"""The daemon's life cycle as systemd and clients see it, on one live `gpushare serve` (real
SmolLM2 model, loopback port) for the whole module, in order: start, engine stall, SIGHUP
reloads (good, then broken), SIGTERM drain.

systemd is stood in for by a real AF_UNIX datagram socket passed as NOTIFY_SOCKET, with
WATCHDOG_USEC=1s; a thread records every datagram the daemon sends. The engine loop is
stalled through the daemon's test hook (GPUSHARE_TEST_STALL_FILE): while the file exists
the engine thread sleeps after each step.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from http.client import HTTPConnection
from pathlib import Path

import pytest

from daemon_fixture import MODEL, START_TIMEOUT_S, Daemon, spawn_daemon, wait_for, write_config

ALICE, BOB = "alice-secret-key", "bob-secret-key"
COPY = "smollm2-copy:135m"  # the model a reload adds: the same file under a second name


def tenants(alice_max_concurrent) -> list[dict]:
    return [{"name": "alice", "api_keys": [ALICE], "max_concurrent": alice_max_concurrent, "max_queued": 0},
            {"name": "bob", "api_keys": [BOB]}]


class NotifySocket:
    """systemd's side of sd_notify: records (monotonic time, {KEY: VALUE}) for each datagram."""

    def __init__(self) -> None:
        # Short directory: AF_UNIX paths are limited to 107 bytes.
        self.dir = tempfile.mkdtemp(prefix="gsl-", dir="/tmp")
        self.path = os.path.join(self.dir, "notify.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.messages: list[tuple[float, dict]] = []
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:  # closed
                return
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            self.messages.append((time.monotonic(), fields))

    def find(self, key: str, start: int = 0, value: str | None = None) -> int | None:
        """Index of the first message from `start` on that has `key` (= `value`, if given)."""
        for i, (_, m) in enumerate(self.messages[start:], start):
            if key in m and (value is None or m[key] == value):
                return i
        return None

    def wait(self, key: str, start: int = 0, value: str | None = None, timeout_s: float = 30) -> int:
        index = wait_for(lambda: self.find(key, start, value), timeout_s)
        assert index is not None, f"no {key}={value or '*'} after message {start}: {self.messages[start:]}"
        return index

    def pings_between(self, t0: float, t1: float) -> list[float]:
        return [t for t, m in self.messages if m.get("WATCHDOG") == "1" and t0 <= t <= t1]

    def close(self) -> None:
        self.sock.close()
        os.unlink(self.path)
        os.rmdir(self.dir)


@dataclass
class Service:
    daemon: Daemon
    notify: NotifySocket
    config: Path
    stall_file: Path
    model_path: str

    @property
    def port(self) -> int:
        return int(self.daemon.host.split(":")[1])

    def rewrite_config(self, overrides: dict) -> None:
        write_config(self.config.parent, self.port, self.model_path, {"server": {"drain_timeout": "30s"}, **overrides})

    def stream(self, key: str, num_predict: int) -> tuple[HTTPConnection, object]:
        """A streaming /api/generate, its first chunk read: the request is in flight."""
        conn = HTTPConnection("127.0.0.1", self.port, timeout=120)
        body = {"model": MODEL, "prompt": "Tell me a long story about a lighthouse.", "options": {
            "num_predict": num_predict, "temperature": 0}}
        conn.request("POST", "/api/generate", json.dumps(body), {"Authorization": f"Bearer {key}"})
        resp = conn.getresponse()
        assert resp.status == 200
        assert json.loads(resp.readline())["done"] is False
        return conn, resp


def call(service: Service, method: str, path: str, body=None, key: str | None = None, timeout_s: float = 120):
    """(status, JSON body, headers) of one request; never raises on an HTTP error status."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(service.daemon.url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def rest_of_stream(resp) -> list[dict]:
    return list(_chunks(resp))


@pytest.fixture(scope="module")
def service(tmp_path_factory, smollm2_path):
    tmp = tmp_path_factory.mktemp("lifecycle")
    notify_socket = NotifySocket()
    stall_file = tmp / "stall"
    daemon = spawn_daemon(tmp, smollm2_path, {"server": {"drain_timeout": "30s"}, "tenants": tenants(1)},
                          env={"NOTIFY_SOCKET": notify_socket.path, "WATCHDOG_USEC": "1000000",
                               "GPUSHARE_TEST_STALL_FILE": str(stall_file)})
    proc, config = daemon.proc, tmp / "gpushare.yaml"
    svc = Service(daemon, notify_socket, config, stall_file, smollm2_path)

    def ready():
        assert proc.poll() is None, f"gpushare serve exited with {proc.returncode}:\n{daemon.log()}"
        try:
            return call(svc, "GET", "/ready", timeout_s=5)[0] == 200
        except (urllib.error.URLError, ConnectionError):
            return False

    try:
        assert wait_for(ready, START_TIMEOUT_S, 0.2), f"not ready in {START_TIMEOUT_S}s:\n{daemon.log()}"
        yield svc
    finally:
        stall_file.unlink(missing_ok=True)
        daemon.stop()
        notify_socket.close()


def test_start_sends_extend_timeout_then_ready_and_watchdog_pings(service):
    sock = service.notify
    extend = sock.find("EXTEND_TIMEOUT_USEC")
    ready = sock.wait("READY", value="1")
    assert extend is not None and extend < ready  # the preload asked for time before READY
    assert int(sock.messages[extend][1]["EXTEND_TIMEOUT_USEC"]) > 0
    assert "loading smollm2:135m" in sock.messages[sock.find("STATUS")][1]["STATUS"]
    assert sock.messages[ready][1]["STATUS"].startswith(f"serving: 1 model loaded ({MODEL})")
    now = time.monotonic()
    wait_for(lambda: len(sock.pings_between(now, now + 10)) >= 2, 5)
    assert len(sock.pings_between(now, now + 10)) >= 2  # every WATCHDOG_USEC/2
    assert call(service, "GET", "/ready")[:2] == (200, {"status": "serving"})
    status, body, _ = call(service, "GET", "/health")
    assert status == 200 and body["status"] == "ok"


def test_a_stalled_engine_loop_stops_the_watchdog_pings(service):
    sock = service.notify
    service.stall_file.touch()
    answers = []
    request = threading.Thread(target=lambda: answers.append(call(service, "POST", "/api/generate", {
        "model": MODEL, "prompt": "Hi", "stream": False, "options": {"num_predict": 3, "temperature": 0}}, key=BOB)))
    request.start()
    try:
        # /health fails once the loop has been silent for max(WATCHDOG_USEC, 2 s).
        assert wait_for(lambda: call(service, "GET", "/health", timeout_s=5)[0] == 503, 20)
        assert call(service, "GET", "/health")[1]["status"] == "engine stalled"
        stalled_at = time.monotonic()
        stall_status = sock.wait("STATUS", len(sock.messages), timeout_s=5)
        assert "ENGINE LOOP STALLED" in sock.messages[stall_status][1]["STATUS"]
        time.sleep(max(0.0, stalled_at + 2.5 - time.monotonic()))
        # Pings come every 0.5 s while alive; one sent just before the stall was noticed may still arrive.
        assert sock.pings_between(stalled_at + 0.6, time.monotonic()) == []
    finally:
        service.stall_file.unlink()
    resumed_at = time.monotonic()
    assert wait_for(lambda: sock.pings_between(resumed_at, resumed_at + 10), 5)
    request.join(60)
    assert answers and answers[0][0] == 200 and answers[0][1]["done"] is True
    assert call(service, "GET", "/health")[0] == 200


def test_sighup_applies_a_tenant_limit_and_a_new_model_while_a_stream_runs(service):
    sock = service.notify
    service.stall_file.touch()  # the stream stops after its first token until the reload has begun
    conn, resp = service.stream(ALICE, 40)
    chunks: list[tuple[float, dict]] = []  # (arrival, chunk), read as they come
    reader = threading.Thread(target=lambda: chunks.extend((time.monotonic(), c) for c in _chunks(resp)))
    reader.start()
    second = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    status, body, _ = call(service, "POST", "/v1/completions", second, key=ALICE)
    assert status == 429 and body["error"]["code"] == "max_concurrent"  # alice: 1 at a time, no queue

    service.rewrite_config({"tenants": tenants(2), "models": [
        {"name": MODEL, "path": service.model_path, "preload": True}, {"name": COPY, "path": service.model_path}]})
    mark = len(sock.messages)
    service.daemon.proc.send_signal(signal.SIGHUP)
    try:
        reloading = sock.wait("RELOADING", mark, value="1")
    finally:
        service.stall_file.unlink()
    assert int(sock.messages[reloading][1]["MONOTONIC_USEC"]) > 0
    ready = sock.wait("READY", reloading, value="1")
    assert "FAILED" not in sock.messages[ready][1]["STATUS"]

    status, body, _ = call(service, "POST", "/v1/completions", second, key=ALICE)
    assert status == 200 and body["usage"]["completion_tokens"] >= 1  # alice may now run 2 at a time
    names = {m["name"] for m in call(service, "GET", "/api/tags", key=ALICE)[1]["models"]}
    assert names == {MODEL, COPY}

    reader.join(60)
    conn.close()
    last = chunks[-1][1]
    assert last["done"] is True and "error" not in last
    assert last["done_reason"] == "length" and last["eval_count"] == 40  # ran to the end of num_predict
    assert chunks[-1][0] > sock.messages[ready][0]  # it was still generating after READY


def _chunks(resp):
    for line in resp:
        if line.strip():
            yield json.loads(line)


def test_a_broken_config_is_rejected_whole_and_the_old_one_keeps_serving(service):
    sock = service.notify
    # Invalid tenant limit, together with a valid change (dropping the copy) that must not apply either.
    service.rewrite_config({"tenants": tenants("lots")})
    mark = len(sock.messages)
    service.daemon.proc.send_signal(signal.SIGHUP)
    reloading = sock.wait("RELOADING", mark, value="1")
    ready = sock.wait("READY", reloading, value="1")
    status_line = sock.messages[ready][1]["STATUS"]
    assert "config reload FAILED, still serving the previous config" in status_line
    assert "tenants[0].max_concurrent: must be a positive integer" in status_line
    assert "config reload rejected" in service.daemon.log()

    names = {m["name"] for m in call(service, "GET", "/api/tags", key=ALICE)[1]["models"]}
    assert names == {MODEL, COPY}
    assert call(service, "GET", "/api/tags")[0] == 401  # tenants still required
    assert call(service, "GET", "/ready")[0] == 200


def test_sigterm_drains_the_stream_in_flight_refuses_new_requests_and_exits_0(service):
    """Last: stops the module's daemon."""
    sock = service.notify
    service.stall_file.touch()  # the stream stops after its first token while we look at the draining daemon
    conn, resp = service.stream(ALICE, 20)
    mark = len(sock.messages)
    service.daemon.proc.send_signal(signal.SIGTERM)
    sock.wait("STOPPING", mark, value="1")

    status, body, headers = call(service, "POST", "/api/generate", {"model": MODEL, "prompt": "Hi"}, key=BOB)
    assert status == 503 and "shutting down" in body["error"] and headers["Retry-After"]
    status, body, _ = call(service, "POST", "/v1/chat/completions",
                           {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}, key=BOB)
    assert status == 503 and body["error"]["type"] == "server_error" and "shutting down" in body["error"]["message"]
    assert call(service, "GET", "/ready")[:2] == (503, {"status": "draining"})
    assert service.daemon.proc.poll() is None

    service.stall_file.unlink()
    lines = rest_of_stream(resp)
    conn.close()
    assert lines[-1]["done"] is True and "error" not in lines[-1]
    assert service.daemon.proc.wait(60) == 0
    assert "stopped" in service.daemon.log()
