"""A real headless Chromium (Debian's chromium and chromium-driver) driven by selenium, for the
status page tests: a fresh profile each time, no background traffic of its own, its network log
(Chrome's performance log) and console kept for the tests to read.

`make setup` installs both packages as root on Debian; elsewhere the browser tests skip, naming
what is missing. Screenshots go to $GPUSHARE_SCREENSHOTS when set (the README's come from there),
else to the test's temporary folder.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
QUIET_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
               "--window-size=1400,1100", "--hide-scrollbars")


def require_chromium() -> None:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        pytest.skip(f"{' and '.join(missing)} missing: install Debian's chromium and chromium-driver "
                    f"(make setup does, as root on Debian)")


@contextmanager
def chromium():
    """A selenium WebDriver on a fresh headless Chromium; quits it and removes its profile on leaving."""
    require_chromium()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="gpushare-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*QUIET_FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def network_events(driver) -> list[tuple[str, dict]]:
    """(DevTools method, params) of the Network.* events since the last call (Chrome's performance log)."""
    events = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"].startswith("Network."):
            events.append((message["method"], message["params"]))
    return events


def requested_urls(driver) -> list[str]:
    """Every URL the page asked for since the last call (Network.requestWillBeSent; a request the
    browser then blocks, say by the CSP, is asked for too)."""
    return [p["request"]["url"] for method, p in network_events(driver) if method == "Network.requestWillBeSent"]


def console_errors(driver) -> list[str]:
    """The console's SEVERE entries since the last call."""
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def screenshot(driver, name: str, fallback_dir: Path) -> Path:
    """The whole page (the window grows to its height) as NAME.png."""
    folder = Path(os.environ.get("GPUSHARE_SCREENSHOTS") or fallback_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.png"
    width = driver.get_window_size()["width"]
    driver.set_window_size(width, driver.execute_script("return document.documentElement.scrollHeight") + 140)
    driver.save_screenshot(str(path))
    return path


def table_rows(driver, table_id: str) -> list[list[str]]:
    """The visible text of each cell of a table's body, read at one instant (the page redraws every second)."""
    return driver.execute_script("return [...document.querySelectorAll(`#${arguments[0]} tbody tr`)]"
                                 ".map(tr => [...tr.cells].map(td => td.innerText.trim()))", table_id)


def model_row(driver, name: str) -> dict | None:
    """The Models table's row for `name`, as text by column heading (None: not shown)."""
    heads = [th.text for th in driver.find_elements(By.CSS_SELECTOR, "#models thead th")]
    return next((dict(zip(heads, cells)) for cells in table_rows(driver, "models") if cells[0] == name), None)


def wait_until(driver, predicate, timeout_s: float = 20):
    """predicate()'s first truthy value; an element redrawn under it (stale) just means: look again."""
    return WebDriverWait(driver, timeout_s, poll_frequency=0.2,
                         ignored_exceptions=[StaleElementReferenceException]).until(lambda d: predicate())
