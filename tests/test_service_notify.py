"""sd_notify as systemd sees it: a real AF_UNIX datagram socket stands in for systemd's
notify socket and receives exactly the bytes each call sends, through systemd-python
(libsystemd) when installed and through the pure-Python sender."""

import logging
import os
import re
import socket
import tempfile
import threading
import time
import uuid

import pytest

from gpushare.service import notify


@pytest.fixture(params=["systemd-python", "pure-python"])
def backend(request, monkeypatch):
    if request.param == "systemd-python":
        if notify.sd_daemon is None:
            pytest.skip("systemd-python not installed (apt libsystemd-dev pkg-config; "
                        "pip install systemd-python)")
    else:
        monkeypatch.setattr(notify, "sd_daemon", None)
    return request.param


def _bind_receiver(monkeypatch, abstract: bool):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if abstract:
        name = f"gpushare-test-{uuid.uuid4().hex}"
        sock.bind("\0" + name)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        return sock, None
    # Short directory: AF_UNIX paths are limited to 107 bytes, pytest's tmp_path can be long.
    directory = tempfile.mkdtemp(prefix="gsn-", dir="/tmp")
    path = os.path.join(directory, "notify.sock")
    sock.bind(path)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    return sock, directory


def _receiver(monkeypatch, abstract: bool):
    sock, directory = _bind_receiver(monkeypatch, abstract)
    sock.settimeout(5)
    yield sock
    sock.close()
    if directory:
        os.unlink(os.path.join(directory, "notify.sock"))
        os.rmdir(directory)


@pytest.fixture(params=["path", "abstract"])
def systemd_socket(request, monkeypatch):
    yield from _receiver(monkeypatch, abstract=request.param == "abstract")


@pytest.fixture
def path_socket(monkeypatch):
    """For the slower watchdog tests: the address kind is covered above."""
    yield from _receiver(monkeypatch, abstract=False)


def test_each_call_sends_exactly_its_message(backend, systemd_socket):
    assert notify.ready("serving 2 models")
    assert systemd_socket.recv(4096) == b"READY=1\nSTATUS=serving 2 models"
    assert notify.ready()
    assert systemd_socket.recv(4096) == b"READY=1"
    assert notify.status("loading smollm2:135m")
    assert systemd_socket.recv(4096) == b"STATUS=loading smollm2:135m"
    assert notify.extend_timeout(90_000_000)
    assert systemd_socket.recv(4096) == b"EXTEND_TIMEOUT_USEC=90000000"
    assert notify.stopping()
    assert systemd_socket.recv(4096) == b"STOPPING=1"
    assert notify.notify("WATCHDOG=1")
    assert systemd_socket.recv(4096) == b"WATCHDOG=1"


def test_reloading_carries_the_monotonic_clock(backend, systemd_socket):
    before_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert notify.reloading()
    after_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    match = re.fullmatch(rb"RELOADING=1\nMONOTONIC_USEC=(\d+)", systemd_socket.recv(4096))
    assert match, "unexpected reload message"
    assert before_usec <= int(match.group(1)) <= after_usec


def test_status_text_cannot_inject_assignments(backend, systemd_socket):
    assert notify.status("model a\nREADY=1")
    assert systemd_socket.recv(4096) == b"STATUS=model a READY=1"


def test_without_notify_socket_nothing_is_sent_and_nothing_fails(backend, monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify.ready("x") is False
    assert notify.reloading() is False
    assert notify.stopping() is False
    assert notify.status("x") is False
    assert notify.extend_timeout(1) is False


def test_unreachable_socket_is_logged_not_raised(backend, monkeypatch, caplog):
    monkeypatch.setenv("NOTIFY_SOCKET", f"/tmp/gpushare-no-such-dir-{uuid.uuid4().hex}/notify")
    with caplog.at_level(logging.WARNING, logger="gpushare.service.notify"):
        assert notify.ready() is False
    assert "READY=1" in caplog.text


def test_watchdog_interval_follows_systemd_environment(monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert notify.watchdog_interval_s() == 30.0
    monkeypatch.delenv("WATCHDOG_PID")
    assert notify.watchdog_interval_s() == 30.0
    # Meant for another process, e.g. the parent that exec'd us or forked a worker.
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    assert notify.watchdog_interval_s() is None
    monkeypatch.delenv("WATCHDOG_PID")
    monkeypatch.delenv("WATCHDOG_USEC")
    assert notify.watchdog_interval_s() is None


def _pings_within(sock, seconds: float) -> int:
    pings = 0
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            assert sock.recv(4096) == b"WATCHDOG=1"
        except TimeoutError:
            break
        pings += 1
    return pings


def test_watchdog_pings_only_while_engine_is_alive(backend, path_socket, monkeypatch):
    # WatchdogSec=0.1s as systemd would pass it: a ping every 50 ms.
    monkeypatch.setenv("WATCHDOG_USEC", "100000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    engine_alive = threading.Event()
    engine_alive.set()
    watchdog = notify.Watchdog(engine_alive.is_set)
    assert watchdog.start()
    try:
        assert _pings_within(path_socket, 0.5) >= 3

        engine_alive.clear()
        _pings_within(path_socket, 0.15)  # drain a ping already in flight
        assert _pings_within(path_socket, 0.4) == 0, "a stalled engine must get no pings"

        engine_alive.set()
        assert _pings_within(path_socket, 0.5) >= 3
    finally:
        watchdog.stop()
    _pings_within(path_socket, 0.1)
    assert _pings_within(path_socket, 0.3) == 0, "stop() must end the pings"


def test_watchdog_treats_a_failing_liveness_check_as_dead(path_socket, caplog):
    def broken_check():
        raise RuntimeError("engine state unreadable")

    watchdog = notify.Watchdog(broken_check, interval_s=0.1)
    with caplog.at_level(logging.ERROR, logger="gpushare.service.notify"):
        assert watchdog.start()
        try:
            assert _pings_within(path_socket, 0.3) == 0
        finally:
            watchdog.stop()
    assert "engine state unreadable" in caplog.text
    assert "withholding watchdog pings" in caplog.text


def test_watchdog_does_not_start_when_systemd_asked_for_none(monkeypatch):
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    watchdog = notify.Watchdog(lambda: True)
    assert watchdog.start() is False
    watchdog.stop()
