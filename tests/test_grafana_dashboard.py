"""deploy/grafana/gpushare-node.json: a well-formed Grafana dashboard model whose every query is
valid PromQL (promql-parser) naming only metrics a live daemon exports, after real traffic, a load
and an unload (prometheus-client's own text parser reads the scrape). GPU series need NVML: the
scrape's are checked where a driver is present, else the collector's, fed a recorded NVML capture."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import promql_parser
import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon_fixture import MODEL, http, serving, wait_for
from gpushare.api import metrics as metrics_module
from gpushare.node.gpu import read_gpus

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "node"))
from node_fakes import XEON_GPUS, FakeNvml  # noqa: E402

DASHBOARD = Path(__file__).parent.parent / "deploy" / "grafana" / "gpushare-node.json"
ADMIN_KEY = "ops-dashboard-key"
SPARE = "smollm2:spare"
GRID_COLUMNS = 24
# What Grafana puts in place of its own variables, for parsing (any valid value will do).
BUILTINS = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h"}
LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>\w+)\)$")


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def variables(board: dict) -> dict[str, dict]:
    return {v["name"]: v for v in board["templating"]["list"]}


def promql(expr: str, board: dict) -> str:
    """`expr` with Grafana's variables replaced: builtins by a duration, the dashboard's by a regex."""
    for name, value in BUILTINS.items():
        expr = expr.replace(name, value)
    for name in variables(board):
        expr = expr.replace(f"${name}", ".*")
    assert "$" not in expr, f"an unknown variable in {expr!r}"
    return expr


def metric_names(node) -> set[str]:
    """Every metric a PromQL syntax tree selects (by name, or by an alternation on __name__)."""
    if isinstance(node, promql_parser.VectorSelector):
        names = {node.name} if node.name else set()
        for m in node.matchers.matchers:
            if m.name == "__name__":
                names |= set(m.value.split("|"))
        return names
    if isinstance(node, promql_parser.MatrixSelector):
        return metric_names(node.vector_selector)
    children = []
    for attr in ("expr", "lhs", "rhs", "param"):
        child = getattr(node, attr, None)
        if child is not None:
            children.append(child)
    children += list(getattr(node, "args", None) or [])
    return set().union(*(metric_names(c) for c in children)) if children else set()


def queries(board: dict) -> list[str]:
    """Every PromQL the dashboard runs: its panels' targets and its variables' label_values selectors."""
    found = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    for v in variables(board).values():
        if v["type"] == "query":
            match = LABEL_VALUES.match(v["query"]["query"])
            assert match, f"variable {v['name']}: not a label_values(selector, label) query"
            found.append(match["selector"])
    return found


def names_in_dashboard(board: dict) -> set[str]:
    return set().union(*(metric_names(promql_parser.parse(promql(q, board))) for q in queries(board)))


def test_the_dashboard_model_is_well_formed():
    board = dashboard()
    assert board["title"] and re.fullmatch(r"[A-Za-z0-9_-]{1,40}", board["uid"])
    assert isinstance(board["schemaVersion"], int) and board["schemaVersion"] >= 36
    ds_vars = [v for v in variables(board).values() if v["type"] == "datasource"]
    assert [v["query"] for v in ds_vars] == ["prometheus"]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    taken = set()
    for p in board["panels"]:
        assert p["type"] in {"row", "timeseries", "stat"} and p["title"]
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "hwxy") and g["x"] >= 0 and g["x"] + g["w"] <= GRID_COLUMNS
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & taken, f"panel {p['title']!r} overlaps another"
        taken |= cells
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": f"${{{ds_vars[0]['name']}}}"}
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs))
    for query in queries(board):
        promql_parser.parse(promql(query, board))  # raises on anything Prometheus would refuse
    sections = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert sections == ["Node overview", "Devices and worker health", "Models: throughput and latency",
                        "KV cache and the shared pool", "Tenants",
                        "Gateway view (vLLM names: gpushare and vLLM pods alike)"]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, smollm2_path):
    models = [{"name": MODEL, "path": smollm2_path, "preload": True}, {"name": SPARE, "path": smollm2_path}]
    tenants = [{"name": "alice", "api_keys": ["alice-dashboard-key"], "kv_reserved": "4MiB", "kv_limit": "64MiB"},
               {"name": "ops", "api_keys": [ADMIN_KEY], "admin": True}]
    with serving(tmp_path_factory.mktemp("dashboard"), smollm2_path, {"models": models, "tenants": tenants}) as d:
        yield d


def exported_names(daemon) -> set[str]:
    status, text, _ = http("GET", daemon.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert status == 200
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def test_every_metric_the_dashboard_names_is_exported(daemon, monkeypatch):
    headers = {"Authorization": "Bearer alice-dashboard-key"}
    body = {"model": MODEL, "prompt": "Hi", "stream": False, "options": {"num_predict": 3, "temperature": 0}}
    assert http("POST", daemon.url + "/api/generate", body, headers=headers)[0] == 200
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    assert http("POST", daemon.url + "/api/load", {"model": SPARE}, headers=admin, timeout_s=300)[0] == 200
    exported_names(daemon)  # a scrape samples the registry: the load is seen before the unload
    assert http("POST", daemon.url + "/api/generate", {"model": SPARE, "keep_alive": 0}, headers=admin)[0] == 200
    loaded = lambda: {m["name"] for m in http("GET", daemon.url + "/api/ps", headers=admin)[1]["models"]}  # noqa: E731
    assert wait_for(lambda: SPARE not in loaded(), 30, 0.5)
    exported = exported_names(daemon)
    if not read_gpus().available:  # no driver here: the GPU families as the collector writes them from a capture
        monkeypatch.setattr(metrics_module, "read_nvml_gpus", lambda: read_gpus(FakeNvml(XEON_GPUS)))
        gpu_families = metrics_module.StateCollector(None)._gpu_families()
        exported |= {s.name for family in gpu_families for s in family.samples}
    wanted = names_in_dashboard(dashboard())
    assert {"vllm:kv_cache_usage_perc", "gpushare_request_queue_time_seconds_bucket",
            "gpushare_request_duration_seconds_bucket", "gpushare_gpu_utilization_percent"} <= wanted
    assert sorted(wanted - exported) == []
