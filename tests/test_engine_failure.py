"""A live daemon whose engine loop fails for good: streams end with an error, new work gets 503,
/health and /ready say why, the systemd watchdog stops, and the daemon itself stays up.

The failure is injected through the daemon's test hook (GPUSHARE_TEST_STALL_FILE reading
"raise": the engine's after-step hook raises, outside the model step and outside any request).
systemd is stood in for by test_daemon_lifecycle's NotifySocket, with WATCHDOG_USEC=1s.
"""

from __future__ import annotations

import json
import time
from http.client import HTTPConnection

import pytest
from daemon_fixture import MODEL, http, spawn_daemon, wait_for
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


def test_a_failed_engine_loop_ends_streams_refuses_work_and_stops_the_watchdog(failing):
    daemon, notify, stall_file, port = failing
    conn = HTTPConnection("127.0.0.1", port, timeout=120)
    body = {"model": MODEL, "prompt": "Tell me a long story about a lighthouse.",
            "options": {"num_predict": 500, "temperature": 0}}
    conn.request("POST", "/api/generate", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.readline())["done"] is False

    stall_file.write_text("raise")
    chunks = [json.loads(line) for line in resp]  # the stream must end, not hang
    assert "error" in chunks[-1] and "engine" in chunks[-1]["error"]
    assert not any(c.get("done") for c in chunks)

    status, health, _ = http("GET", daemon.url + "/health")
    assert status == 503 and health["status"] == "engine stopped" and "test hook" in health["error"]
    status, ready, _ = http("GET", daemon.url + "/ready")
    assert status == 503 and ready["status"] == "engine failed" and "test hook" in ready["error"]
    for path, req in (("/api/generate", {"model": MODEL, "prompt": "Hi", "stream": False}),
                      ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}),
                      ("/api/embed", {"model": MODEL, "input": "Hi"})):
        status, answer, _ = http("POST", daemon.url + path, req, headers={"Content-Type": "application/json"})
        assert status == 503, (path, answer)
        assert "engine is down" in json.dumps(answer)

    failed_at = time.monotonic()
    assert wait_for(lambda: any("ENGINE FAILED" in m.get("STATUS", "") for _, m in notify.messages), 15)
    time.sleep(2.5)
    # Pings came every 0.5 s while alive; none once the engine is gone (one in flight may still land).
    assert notify.pings_between(failed_at + 1.0, time.monotonic()) == []
    assert daemon.proc.poll() is None  # the daemon stays up to say what happened
