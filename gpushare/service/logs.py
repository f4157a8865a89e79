"""Logging setup for the daemon: the journal when systemd runs it, stderr otherwise.

Under systemd (JOURNAL_STREAM or INVOCATION_ID set) with systemd-python installed, records
go to journald as structured entries (PRIORITY, LOGGER, THREAD_NAME, CODE_FILE...), so
`journalctl -u gpushare -p warning` filters by level. Under systemd without systemd-python,
stderr already reaches the journal, and each line starts with "<N>", the syslog priority
prefix journald reads (sd-daemon(3)); the journal stamps the time itself. Elsewhere: plain
timestamped lines on stderr.
"""

from __future__ import annotations

import logging
import os
import sys

try:
    from systemd.journal import JournalHandler
except ImportError:
    JournalHandler = None

SYSLOG_IDENTIFIER = "gpushare"
TERMINAL_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
JOURNAL_FORMAT = "%(name)s: %(message)s"


def running_under_systemd() -> bool:
    return bool(os.environ.get("JOURNAL_STREAM") or os.environ.get("INVOCATION_ID"))


def syslog_priority(levelno: int) -> int:
    """Python level -> syslog priority (3 err, 4 warning, 6 info, 7 debug)."""
    if levelno >= logging.CRITICAL:
        return 2
    if levelno >= logging.ERROR:
        return 3
    if levelno >= logging.WARNING:
        return 4
    if levelno >= logging.INFO:
        return 6
    return 7


class SyslogPrefixFormatter(logging.Formatter):
    """Prefixes each record with "<priority>" for journald's stderr reader."""

    def format(self, record: logging.LogRecord) -> str:
        return f"<{syslog_priority(record.levelno)}>{super().format(record)}"


def setup_logging(level: int | str = "INFO") -> logging.Handler:
    """Route the root logger to the journal or stderr (replacing earlier handlers) at
    `level` (a logging level or its name, any case). Returns the handler installed."""
    if isinstance(level, str):
        level = level.upper()
    if running_under_systemd() and JournalHandler is not None:
        handler: logging.Handler = JournalHandler(SYSLOG_IDENTIFIER=SYSLOG_IDENTIFIER)
        handler.setFormatter(logging.Formatter(JOURNAL_FORMAT))
    elif running_under_systemd():
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(SyslogPrefixFormatter(JOURNAL_FORMAT))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(TERMINAL_FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    return handler
