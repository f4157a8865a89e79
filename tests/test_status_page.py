"""The status page at /ui in a real headless Chromium against a live daemon (real SmolLM2): what a
person sees there matches /api/ps and /metrics, it follows a generation as it runs, its load and
unload buttons ask first, it fetches nothing from elsewhere and logs no error, and the browser
enforces its Content-Security-Policy. Screenshots are saved (see browser_fixture.py)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from selenium.webdriver.common.by import By

from browser_fixture import (chromium, console_errors, model_row, network_events, requested_urls, screenshot,
                             table_rows, wait_until)
from daemon_fixture import MODEL, http, long_stream, serving, wait_for

SPARE = "smollm2:spare"  # the same file under a second name, not preloaded: what the Load button loads
LOAD_TIMEOUT_S = 180


def fmt_bytes(n: int) -> str:
    """As the page writes bytes (ui.js fmtBytes)."""
    value, unit = float(n), 0
    while value >= 1024 and unit < 4:
        value /= 1024
        unit += 1
    return f"{n} B" if unit == 0 else f"{value:.1f} {['B', 'KiB', 'MiB', 'GiB', 'TiB'][unit]}"


def scrape(daemon) -> dict[tuple, float]:
    status, text, _ = http("GET", daemon.url + "/metrics")
    assert status == 200
    return {(s.name, *sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def device_card(driver, device: str) -> dict[str, str]:
    """The device's card as {class name: its text}, read at one instant (cards are redrawn every second)."""
    return driver.execute_script("const card = document.querySelector(`.device[data-device='${arguments[0]}']`);"
                                 "return Object.fromEntries([...card.querySelectorAll('[class]')]"
                                 ".map(e => [e.className, e.innerText.trim()]))", device)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, smollm2_path):
    models = [{"name": MODEL, "path": smollm2_path, "preload": True}, {"name": SPARE, "path": smollm2_path}]
    with serving(tmp_path_factory.mktemp("ui"), smollm2_path, {"models": models}) as d:
        yield d


@pytest.fixture(scope="module")
def page(daemon):
    with chromium() as driver:
        driver.get(daemon.url + "/ui")
        wait_until(driver, lambda: model_row(driver, MODEL))
        yield driver


def test_the_page_shows_what_api_ps_and_metrics_say(page, daemon, tmp_path):
    ps = daemon.loaded()[MODEL]
    m = scrape(daemon)
    row = wait_until(page, lambda: model_row(page, MODEL))
    assert row["Device"] == ps["device"] == "cpu" and row["State"] == "loaded"
    assert row["KV blocks"] == f"{ps['kv_blocks_used']} / {ps['kv_blocks_total']}"
    assert int(m[("gpushare_kv_blocks_total", ("model", MODEL))]) == ps["kv_blocks_total"]
    assert row["Size"] == fmt_bytes(ps["size"]) and row["Running"] == "0" and row["Queued"] == "0"
    assert row["Keep-alive ends"].startswith("in ")  # keep_alive 5m, counting down
    card = device_card(page, "cpu")
    assert card["pid"] == f"pid {ps['worker_pid']}"
    assert card["healthy"] == "healthy" and m[("gpushare_device_healthy", ("device", "cpu"))] == 1
    restarts = int(m[("gpushare_device_worker_restarts_total", ("device", "cpu"))])
    assert card["restarts"] == f"{restarts} restarts"
    assert card["legend-weights"] == f"weights {fmt_bytes(ps['weight_bytes'])}"
    assert [cells[0] for cells in table_rows(page, "tenants")] == ["default"]
    screenshot(page, "status-page-idle", tmp_path)


def test_the_page_follows_a_generation_as_it_runs(page, daemon, tmp_path):
    ttft_before_s = scrape(daemon).get(("gpushare_time_to_first_token_seconds_sum", ("model", MODEL),
                                        ("tenant", "default")), 0.0)
    conn = long_stream(daemon)  # runs until closed
    try:
        # Its first token came just now: the TTFT chart's p50 and p99 (last 10 s) are that one request's.
        shown = wait_until(page, lambda: (t := page.find_element(By.ID, "now-ttft").text) and "–" not in t and t)
        row = wait_until(page, lambda: (r := model_row(page, MODEL)) and r["Running"] == "1" and
                         float(r["Tokens/s"]) > 0 and r)
        first_used = int(row["KV blocks"].split(" / ")[0])
        assert first_used >= 1
        # A 2,000-token answer takes a new 16-token block every 16 tokens: the page shows it grow.
        wait_until(page, lambda: int(model_row(page, MODEL)["KV blocks"].split(" / ")[0]) > first_used, 60)
        assert float(page.find_element(By.ID, "now-tokens").text) > 0
        assert page.find_element(By.ID, "now-queue").text == "0 / 1"
        assert table_rows(page, "tenants")[0][5] == "1"  # default's running
        screenshot(page, "status-page", tmp_path)
    finally:
        conn.close()
    wait_until(page, lambda: model_row(page, MODEL)["Running"] == "0")
    p50, p99 = (float(v) for v in shown.split(" / "))
    ttft_s = wait_for(lambda: scrape(daemon).get(("gpushare_time_to_first_token_seconds_sum", ("model", MODEL),
                                                  ("tenant", "default"))), 10) - ttft_before_s
    assert p50 == p99 == pytest.approx(ttft_s, abs=0.0005)  # /metrics counts it once the request ends


def test_load_and_unload_buttons_ask_first(page, daemon):
    page.find_element(By.ID, "catalog-refresh").click()
    load = wait_until(page, lambda: page.find_elements(By.CSS_SELECTOR, f'#catalog tr[data-key="{SPARE}"] button'))
    load[0].click()
    alert = wait_until(page, lambda: page.switch_to.alert)
    assert SPARE in alert.text
    alert.dismiss()  # "Cancel": nothing is asked of the daemon
    assert not any("/api/load" in url for url in requested_urls(page))
    assert SPARE not in daemon.loaded()
    load[0].click()
    wait_until(page, lambda: page.switch_to.alert).accept()
    assert wait_for(lambda: SPARE in daemon.loaded(), LOAD_TIMEOUT_S, 0.5)
    wait_until(page, lambda: (r := model_row(page, SPARE)) and r["State"] == "loaded", 30)
    assert page.find_element(By.ID, "action-status").text.startswith(f"loaded {SPARE} in ")

    unload = page.find_element(By.CSS_SELECTOR, f'#models tr[data-key="{SPARE}@cpu"] button.unload')
    unload.click()
    wait_until(page, lambda: page.switch_to.alert).accept()
    assert wait_for(lambda: SPARE not in daemon.loaded(), 30, 0.5)
    # Unloaded, it stays built in host memory (memory.host_cache): listed as warm, with no Unload button.
    wait_until(page, lambda: (r := model_row(page, SPARE)) and r["State"] == "warm")
    assert page.find_elements(By.CSS_SELECTOR, f'#models tr[data-key="{SPARE}@cpu"] button') == []
    assert MODEL in daemon.loaded()


def test_nothing_fetched_elsewhere_and_no_console_errors(page, daemon):
    page.refresh()
    wait_until(page, lambda: model_row(page, MODEL))
    urls = requested_urls(page)
    assert any(u.startswith(daemon.url + "/api/status?") for u in urls)
    assert [u for u in urls if not u.startswith(daemon.url + "/")] == []
    assert console_errors(page) == []


def test_the_content_security_policy_is_sent_and_enforced(page, daemon):
    for path in ("/ui", "/ui/ui.js", "/ui/ui.css"):
        status, _, headers = http("GET", daemon.url + path)
        assert status == 200 and headers["X-Content-Type-Options"] == "nosniff"
        policy = dict(p.strip().split(" ", 1) for p in headers["Content-Security-Policy"].split(";"))
        assert policy["default-src"] == "'none'" and policy["script-src"] == "'self'"
        assert policy["connect-src"] == "'self'" and policy["frame-ancestors"] == "'none'"
    # An injected inline script does not run, nor does one from another origin load.
    page.execute_script("""
        const inline = document.createElement('script'); inline.textContent = 'window.ranInline = true';
        document.body.appendChild(inline);
        const outside = document.createElement('script'); outside.src = 'http://192.0.2.1/x.js';
        document.body.appendChild(outside);""")
    assert page.execute_script("return window.ranInline === undefined")
    errors = console_errors(page)
    assert any("Content Security Policy" in e and "inline" in e for e in errors)
    assert any("Content Security Policy" in e and "192.0.2.1" in e for e in errors)
    events = network_events(page)
    outside = {p["requestId"] for method, p in events
               if method == "Network.requestWillBeSent" and "192.0.2.1" in p["request"]["url"]}
    blocked = {p["requestId"] for method, p in events
               if method == "Network.loadingFailed" and p.get("blockedReason") == "csp"}
    assert outside and outside <= blocked  # the browser refused it: nothing went out
