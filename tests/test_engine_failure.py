"""A live daemon whose engine loop fails for good: the streams on it end with the error, its
worker process exits and is started again, /health stays 200 meanwhile (naming the device
unhealthy), the systemd watchdog keeps pinging, and requests are served again once it is back.

The failure is injected through the engine's test hook (GPUSHARE_TEST_STALL_FILE reading
"raise": the engine's after-step hook raises, outside the model step and outside any request).
systemd is stood in for by test_daemon_lifecycle's NotifySocket, with WATCHDOG_USEC=1s.
"""

from __future__ import annotations

import json
import time
from http.client import HTTPConnection

import pytest
from daemon_fixture import MODEL, http, spawn_daemon
from test_daemon_lifecycle import NotifySocket


@pytest.fixture(scope="module")
def failing(tmp_path_factory, smollm2_path):
    tmp = tmp_path_factory.mktemp("engine-failure")
    notify = NotifySocket()
    stall_file = tmp / "stall"
    daemon = spawn_daemon(tmp, smollm2_path, env={"NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": "1000000",
                                                  "GPUSHARE_TEST_STALL_FILE": str(stall_file)})
    port = int(daemon.host.split(":")[1])
    try:
        daemon.wait_ready()
        yield daemon, notify, stall_file, port
    finally:
        daemon.stop()
        notify.close()


def test_a_failed_engine_loop_ends_its_streams_and_its_worker_comes_back(failing):
    daemon, notify, stall_file, port = failing
    (before,) = http("GET", daemon.url + "/health")[1]["devices"]
    conn = HTTPConnection("127.0.0.1", port, timeout=120)
    body = {"model": MODEL, "prompt": "Tell me a long story about a lighthouse.",
            "options": {"num_predict": 500, "temperature": 0}}
    conn.request("POST", "/api/generate", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.readline())["done"] is False

    stall_file.write_text("raise")
    chunks = [json.loads(line) for line in resp]  # the stream must end, not hang
    stall_file.unlink()
    failed_at = time.monotonic()
    assert "error" in chunks[-1] and "engine stopped after an internal error" in chunks[-1]["error"]
    assert "test hook" in chunks[-1]["error"] and not any(c.get("done") for c in chunks)

    status, health, _ = http("GET", daemon.url + "/health")
    assert status == 200 and health["status"] == "ok"
    # Served again: this request waits while the worker restarts, then loads the model there.
    status, answer, _ = http("POST", daemon.url + "/api/generate",
                             {"model": MODEL, "prompt": "Hi", "stream": False,
                              "options": {"num_predict": 3, "temperature": 0}})
    assert status == 200 and answer["done"] is True, answer
    (after,) = http("GET", daemon.url + "/health")[1]["devices"]
    assert after["healthy"] and after["restarts"] == 1 and after["worker_pid"] != before["worker_pid"]
    assert daemon.loaded()[MODEL]["worker_pid"] == after["worker_pid"]
    assert "exited with code 3" in daemon.log()
    # The supervisor never stalled: the watchdog pinged all along.
    assert len(notify.pings_between(failed_at, time.monotonic())) >= int(time.monotonic() - failed_at) - 1
