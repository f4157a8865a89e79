"""The status page on a node with tenants, in a real headless Chromium: without a key it shows no
node data; a tenant key sees its own row only; an admin key sees every tenant, a page at a time
(1,002 of them), and the 10,001-model catalog a page at a time; the key stays in session storage
and out of every URL; a model name with HTML in it is shown as text. (Tenant names cannot hold
HTML: the config allows letters, digits and _.@- only; a file name can.)"""

from __future__ import annotations

import os

import pytest
from selenium.webdriver.common.by import By

from browser_fixture import (chromium, console_errors, model_row, requested_urls, screenshot, table_rows,
                             wait_until)
from daemon_fixture import MODEL, http, serving

ALICE_KEY = "alice-ui-key"
ADMIN_KEY = "ops-ui-key"
MANY_TENANTS = 1000
MANY_MODELS = 10_000
HTML_NAME = '<img src=x onerror="window.pwned=1">'


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, smollm2_path):
    tmp = tmp_path_factory.mktemp("ui-tenants")
    models = tmp / "models"
    models.mkdir()
    for i in range(MANY_MODELS):
        os.symlink(smollm2_path, models / f"m{i:05d}.gguf")
    os.symlink(smollm2_path, models / f"{HTML_NAME}.gguf")
    tenants = [{"name": "alice", "api_keys": [ALICE_KEY], "kv_limit": "64MiB"},
               {"name": "ops", "api_keys": [ADMIN_KEY], "admin": True},
               *({"name": f"t{i:04d}", "api_keys": [f"key-{i}"]} for i in range(MANY_TENANTS))]
    with serving(tmp, smollm2_path, {"tenants": tenants}) as d:
        yield d


@pytest.fixture(scope="module")
def page(daemon):
    with chromium() as driver:
        driver.get(daemon.url + "/ui")
        yield driver


def use_key(page, key: str) -> None:
    page.execute_script("sessionStorage.clear()")
    page.refresh()
    wait_until(page, lambda: page.find_element(By.ID, "key-input").is_displayed())
    page.find_element(By.ID, "key-input").send_keys(key)
    page.find_element(By.ID, "key-use").click()


def tenant_names(page) -> list[str]:
    return [cells[0] for cells in table_rows(page, "tenants")]


def test_without_a_key_no_node_data_is_shown(page, daemon, tmp_path):
    assert http("GET", daemon.url + "/api/status")[0] == 401
    wait_until(page, lambda: page.find_element(By.ID, "key-input").is_displayed())
    assert not page.find_element(By.ID, "node").is_displayed()
    text = page.find_element(By.TAG_NAME, "body").text
    assert MODEL not in text and "alice" not in text and "pid" not in text
    assert page.find_element(By.ID, "phase").text == "key needed"
    # The one failure in the console is the browser's own line about that 401.
    assert all("401" in e for e in console_errors(page))
    screenshot(page, "status-page-no-key", tmp_path)


def test_a_tenant_key_sees_its_own_row_only(page, daemon):
    use_key(page, ALICE_KEY)
    wait_until(page, lambda: tenant_names(page) == ["alice"])
    assert page.find_element(By.ID, "who").text == "tenant alice"
    assert page.find_element(By.ID, "tenants-count").text == "(1)"
    assert model_row(page, MODEL)["State"] == "loaded"
    for admin_only in ("devices-panel", "charts-panel", "load-panel"):
        assert not page.find_element(By.ID, admin_only).is_displayed()
    assert page.find_elements(By.CSS_SELECTOR, "#models button.unload") == []
    assert table_rows(page, "tenants")[0][3] == "64.0 MiB"  # its kv_limit
    # The key went out as a header, never in a URL, and stays in this tab's session storage.
    assert not any(ALICE_KEY in url for url in requested_urls(page))
    assert page.execute_script("return sessionStorage.getItem('gpushare.apiKey')") == ALICE_KEY
    assert page.execute_script("return localStorage.length") == 0


def test_an_admin_key_sees_every_tenant_a_page_at_a_time(page, daemon, tmp_path):
    use_key(page, ADMIN_KEY)
    total = MANY_TENANTS + 2
    wait_until(page, lambda: page.find_element(By.ID, "tenants-count").text == f"({total})")
    assert page.find_element(By.ID, "who").text == "admin (tenant ops)"
    assert tenant_names(page)[:2] == ["alice", "ops"] and len(tenant_names(page)) == 50
    assert page.find_element(By.CSS_SELECTOR, "#tenants-pager span").text == f"1–50 of {total}"
    page.find_element(By.XPATH, "//div[@id='tenants-pager']/button[text()='Next']").click()
    wait_until(page, lambda: tenant_names(page)[0] == "t0048")
    page.find_element(By.ID, "tenants-filter").send_keys("t09")
    wait_until(page, lambda: page.find_element(By.ID, "tenants-count").text == f"(100 of {total})")
    assert tenant_names(page) == [f"t{i:04d}" for i in range(900, 950)]
    assert page.find_element(By.ID, "devices-panel").is_displayed()
    assert not any(ADMIN_KEY in url for url in requested_urls(page))
    screenshot(page, "status-page-tenants", tmp_path)


def test_ten_thousand_models_list_a_page_at_a_time_and_html_stays_text(page, daemon):
    page.find_element(By.ID, "catalog-refresh").click()
    wait_until(page, lambda: page.find_element(By.ID, "catalog-count").text == f"first 50 of {MANY_MODELS + 1}", 60)
    assert len(table_rows(page, "catalog")) == 50
    page.find_element(By.ID, "catalog-filter").send_keys("<img")
    wait_until(page, lambda: page.find_element(By.ID, "catalog-count").text == "1 not loaded")
    assert [cells[0] for cells in table_rows(page, "catalog")] == [HTML_NAME]
    assert page.find_elements(By.CSS_SELECTOR, "#catalog img") == []
    assert page.execute_script("return window.pwned === undefined")


def test_the_status_json_follows_the_ps_rules(daemon):
    """What the page reads, without a browser: the same rules as /api/ps."""
    def status(key: str | None, query: str = ""):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return http("GET", daemon.url + "/api/status" + query, headers=headers)

    code, body, _ = status(None)
    assert code == 401 and "missing API key" in body["error"]
    code, body, headers = status(ALICE_KEY)
    assert code == 200 and headers["Cache-Control"] == "no-store"
    assert [t["name"] for t in body["tenants"]["rows"]] == ["alice"] and body["tenants"]["total"] == 1
    assert "devices" not in body and "history" not in body and not body["admin"]
    assert [m["name"] for m in body["models"]["rows"]] == [MODEL]
    code, body, _ = status(ADMIN_KEY, "?tenant_filter=T09&tenant_offset=50")
    assert code == 200 and body["admin"] and body["devices"][0]["device"] == "cpu"
    page = body["tenants"]
    assert (page["total"], page["matching"], page["offset"]) == (MANY_TENANTS + 2, 100, 50)
    assert [t["name"] for t in page["rows"]] == [f"t{i:04d}" for i in range(950, 1000)]
    assert all(s["t"] > 0 for s in body["history"])
    since = body["history"][-1]["t"]
    assert all(s["t"] > since for s in status(ADMIN_KEY, f"?since={since}")[1]["history"])
    code, body, _ = status(ADMIN_KEY, "?model_offset=x")
    assert code == 400 and '"model_offset" must be a whole number' in body["error"]
