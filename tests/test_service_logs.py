"""Where the daemon's log records go: the journal under systemd, stderr elsewhere."""

import logging

import pytest

from gpushare.service import logs


@pytest.fixture(autouse=True)
def restore_root_logger(monkeypatch):
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    monkeypatch.delenv("INVOCATION_ID", raising=False)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_terminal_gets_timestamped_lines_on_stderr(capsys):
    logs.setup_logging("debug")
    logging.getLogger("gpushare.engine").debug("step %d took %.1f ms", 7, 3.25)
    err = capsys.readouterr().err
    assert err.endswith("DEBUG gpushare.engine: step 7 took 3.2 ms\n")
    assert err[:4].isdigit(), "line should start with a timestamp"


def test_level_filters_records(capsys):
    logs.setup_logging(logging.WARNING)
    logging.getLogger("gpushare").info("hidden")
    logging.getLogger("gpushare").warning("shown")
    err = capsys.readouterr().err
    assert "hidden" not in err and "shown" in err


def test_under_systemd_without_systemd_python_stderr_lines_carry_priority(monkeypatch, capsys):
    monkeypatch.setattr(logs, "JournalHandler", None)
    monkeypatch.setenv("JOURNAL_STREAM", "8:12345")
    logs.setup_logging("INFO")
    logging.getLogger("gpushare.daemon").error("model file missing")
    logging.getLogger("gpushare.daemon").info("listening")
    assert capsys.readouterr().err.splitlines() == [
        "<3>gpushare.daemon: model file missing",
        "<6>gpushare.daemon: listening",
    ]


def test_under_systemd_records_go_to_the_journal_with_priority(monkeypatch):
    if logs.JournalHandler is None:
        pytest.skip("systemd-python not installed")
    monkeypatch.setenv("INVOCATION_ID", "0123456789abcdef0123456789abcdef")
    handler = logs.setup_logging("INFO")
    assert isinstance(handler, logs.JournalHandler)
    assert logging.getLogger().handlers == [handler]
    # No journald in the test machine: capture what would go down its socket.
    sent = []
    handler.send = lambda MESSAGE, **fields: sent.append((MESSAGE, fields))
    logging.getLogger("gpushare.engine").warning("KV pool %d%% full", 95)
    logging.getLogger("gpushare.engine").debug("below the level")
    assert len(sent) == 1
    message, fields = sent[0]
    assert message == "gpushare.engine: KV pool 95% full"
    assert fields["PRIORITY"] == "4"
    assert fields["SYSLOG_IDENTIFIER"] == "gpushare"
    assert fields["LOGGER"] == "gpushare.engine"
