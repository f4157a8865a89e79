"""TEST ONLY hooks an engine installs from its environment (nothing happens when unset)."""

import logging
import os
import time

log = logging.getLogger("gpushare.engine")

TEST_STALL_ENV = "GPUSHARE_TEST_STALL_FILE"


def install_test_stall(engine) -> None:
    """TEST ONLY: with GPUSHARE_TEST_STALL_FILE=PATH in the environment, the engine thread sleeps
    after each step for as long as PATH exists, so tests can stall the engine loop and watch the
    watchdog pings stop, /health fail, and requests wait. A PATH that reads "raise" makes the next
    step's hook raise instead: the engine loop fails for good (engine.py). Not set: nothing is
    installed."""
    path = os.environ.get(TEST_STALL_ENV)
    if not path:
        return
    log.warning("TEST HOOK %s=%s: the engine stalls after each step while that file exists",
                TEST_STALL_ENV, path)

    def stall_while_file_exists(_engine) -> None:
        while True:
            try:
                with open(path) as f:
                    order = f.read().strip()
            except OSError:  # gone: run on
                return
            if order == "raise":
                raise RuntimeError("test hook: an engine failure outside the model step")
            time.sleep(0.05)

    engine.on_step = stall_while_file_exists
