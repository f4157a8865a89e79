"""benchmarks/gpu_check.py, the device check for a lent GPU, stays wired without a GPU: its parts
import and name real functions, its timeouts fit the 8 minutes it promises, a part that hangs is
recorded and the next one runs, the node probes come out as files in tests/fixtures/node's shape,
and (slow) the whole CPU dry run passes every part."""

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures" / "node"))

import gpu_check  # noqa: E402
import node_fakes  # noqa: E402
from node_fakes import recorded  # noqa: E402


def run_check(tmp_path, *args, timeout_s=600):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(tmp_path), *args],
                          capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT)
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    return done, results


def test_every_part_imports_on_a_cpu_and_the_timeouts_fit_eight_minutes(monkeypatch):
    monkeypatch.setenv("GPU_CHECK_DEVICE", "cpu")
    for name, (module, function, _) in gpu_check.PARTS.items():
        assert callable(getattr(importlib.import_module(module), function)), name
    assert sum(timeout for *_, timeout in gpu_check.PARTS.values()) <= 8 * 60


def test_a_hung_part_is_recorded_and_the_next_runs_and_probes_become_fixtures(tmp_path, monkeypatch):
    done, results = run_check(tmp_path, "--parts", "sampling,node", "--timeout", "sampling=1")
    parts = results["parts"]
    assert list(parts) == ["sampling", "node"]
    assert parts["sampling"]["status"] == "timeout after 1 s", parts["sampling"]
    assert parts["node"]["status"] == "ok", parts["node"]
    assert done.returncode == 1  # not every part passed
    assert "== summary" in done.stdout and "timeout after 1 s" in done.stdout

    # no nvidia-smi here: each probe recorded with the shell's 127, as node/'s tests read recordings
    recorded_outputs = parts["node"]["data"]["recorded"]
    assert any(name.endswith("_nvidia-smi-L.txt") for name in recorded_outputs)
    fixtures = tmp_path / "fixtures"
    subprocess.run([sys.executable, str(SCRIPT), "--fixtures", str(tmp_path / "gpu_check.json"), str(fixtures)],
                   check=True, capture_output=True, timeout=60)
    written = sorted(p.name for p in fixtures.iterdir())
    assert written == sorted(recorded_outputs)
    listing = next(p for p in fixtures.iterdir() if p.name.endswith("_nvidia-smi-L.txt"))
    monkeypatch.setattr(node_fakes, "NVIDIA", fixtures)
    replay = recorded(listing.name)
    assert listing.read_text().splitlines()[1] == "# command: nvidia-smi -L"
    if shutil.which("nvidia-smi") is None:
        assert replay.returncode == 127 and "nvidia-smi: command not found" in replay.stdout


@pytest.mark.slow
def test_the_dry_run_passes_every_part(tmp_path):
    done, results = run_check(tmp_path, timeout_s=1800)
    assert list(results["parts"]) == list(gpu_check.PARTS)
    failed = {name: part["status"] for name, part in results["parts"].items() if part["status"] != "ok"}
    assert not failed, (failed, done.stdout[-4000:])
    assert done.returncode == 0
