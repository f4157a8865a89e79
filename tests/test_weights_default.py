"""What ``auto`` weights give a user on a machine with stale or broken verdict files: a quantized
file stays quantized (int4 for 4-bit, int8 for 8-bit), the files are ignored with a log line, and
`gpushare ps`, /api/ps and /api/show name the format and kernel. The measuring rules (margin, busy
machine, build key) are tested on the functions that make the verdicts, with the machine's CPU
counters (/proc/stat) as the one faked boundary."""

import json
import logging
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from arch_models import hf_to_gguf, save_hf_model
from daemon_fixture import GPUSHARE, MODEL, http, serving

from gpushare.models import cpu_kernels
from gpushare.models.loader import load_model
from gpushare.protocol.weight_format import resolve_weights
from gpushare.node import cpu_verdicts

Q8_MODEL = "tiny-q8:latest"


def q8_0(name: str, array: np.ndarray):
    from gguf import GGMLQuantizationType, quants

    if array.ndim != 2:
        return None
    return quants.quantize(array, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0


def stale_cache(cache: Path) -> Path:
    """``cache`` as an older gpushare left it after one disturbed measurement: weights "float32", and
    kernel verdicts in a format this version does not read. Each user gets its own: a load measures
    on a quiet machine and replaces the broken files."""
    from gpushare.kernels import cpu_ops

    built = cpu_ops.library_path(cpu_ops._compiler()) if cpu_ops.loaded() else None
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(cache))
        (cache / "gpushare").mkdir()
        if built is not None:  # the same build, not rebuilt within the worker's start-up time
            shutil.copy(built, cpu_ops.library_path(cpu_ops._compiler()))
        cpu_verdicts.verdict_file("weights").with_suffix("").write_text("float32")  # the old file's very name
        cpu_verdicts.verdict_file("quantized-kernel").write_text("{not json")
        cpu_verdicts.verdict_file("wide-int8").write_text(json.dumps(
            {"choice": "float32", "build_key": "x", "timings_us": {}, "measured_at": "then"}))
    return cache


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("q8")
    folder = save_hf_model("llama", str(root / "hf"), smollm2_path)
    return hf_to_gguf(folder, str(root / "tiny-q8.gguf"), smollm2_path, quantize=q8_0)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, smollm2_path, q8_file):
    overrides = {"models": [{"name": MODEL, "path": smollm2_path, "preload": True},
                            {"name": Q8_MODEL, "path": q8_file, "preload": True}]}
    with serving(tmp_path_factory.mktemp("weights-default"), smollm2_path, overrides,
                 env={"XDG_CACHE_HOME": str(stale_cache(tmp_path_factory.mktemp("xdg")))}) as d:
        yield d


def test_auto_keeps_quantized_files_quantized_on_every_device():
    assert resolve_weights("auto", "cpu", {"Q4_1"}) == "int4"
    assert resolve_weights("auto", "cpu", {"Q4_0", "IQ4_NL"}) == "int4"
    assert resolve_weights("auto", "cpu", {"Q4_K", "Q6_K"}) == "int8"
    assert resolve_weights("auto", "cpu", {"Q8_0"}) == "int8"
    assert resolve_weights("auto", "cpu", set()) == "float32"
    assert resolve_weights("auto", "cuda", {"Q4_1", "Q4_0"}) == "int4"
    assert resolve_weights("auto", "cuda", {"Q6_K"}) == "int8"
    assert resolve_weights("auto", "cuda", {"bfloat16"}) == "bfloat16"
    assert resolve_weights("float32", "cpu", {"Q4_1"}) == "float32"  # only when the user says so
    with pytest.raises(ValueError, match="int3.*choose from auto, int8, int4"):
        resolve_weights("int3", "cpu", set())


def test_a_float32_verdict_left_behind_does_not_make_a_quantized_file_dense(tmp_path, smollm2_path, q8_file,
                                                                           monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(stale_cache(tmp_path)))
    assert load_model(smollm2_path, weights="auto").weights == "int4"
    assert load_model(q8_file, weights="auto").weights == "int8"


def test_ps_and_show_name_the_format_and_kernel_despite_stale_verdicts(daemon):
    r = subprocess.run([str(GPUSHARE), "ps"], capture_output=True, text=True, env=daemon.env(), timeout=120)
    assert r.returncode == 0, r.stderr
    header, *rows = r.stdout.splitlines()
    assert header.split()[-2:] == ["WEIGHTS", "BASE"]  # BASE: blank but for a LoRA adapter
    by_name = {row.split()[0]: row for row in rows}
    from gpushare.kernels import cpu_ops

    # g++ builds the C++ kernels here, for the best instructions this CPU runs
    instructions = {"avx512": "avx512-vnni", "avxvnni": "avx-vnni"}.get(cpu_ops.isa(), cpu_ops.isa())
    assert by_name[MODEL].endswith(f"int4 cpu-blocks-{instructions}")
    assert "int8 " in by_name[Q8_MODEL] and "float32" not in r.stdout
    status, shown, _ = http("POST", daemon.url + "/api/show", {"model": Q8_MODEL})
    assert status == 200 and shown["weights"] == "int8" and shown["kernel"].split("+")[0].startswith(("cpu-", "torch-"))
    log = daemon.log()
    assert "not a verdict file of this version" in log and "unknown choice 'float32'" in log


def _counters(busy_s_per_s: float, monkeypatch):
    """/proc/stat as a machine whose other processes burn ``busy_s_per_s`` cores."""
    clock = {"t": 0.0}

    def fake_cpu_seconds():
        clock["t"] += 1.0
        return clock["t"], clock["t"] * busy_s_per_s, 0.0

    monkeypatch.setattr(cpu_kernels, "_cpu_seconds", fake_cpu_seconds)
    monkeypatch.setattr(cpu_kernels.time, "sleep", lambda s: None)


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("GPUSHARE_CPU_QUANTIZED_KERNEL", raising=False)
    monkeypatch.delenv("GPUSHARE_KERNELS", raising=False)
    monkeypatch.setattr(cpu_kernels, "kernels_build_key", lambda: "build-a")
    cpu_kernels.forget_verdicts()
    yield tmp_path
    cpu_kernels.forget_verdicts()


def _decide(timings: dict[str, float], calls: list):
    def measure():
        calls.append(1)
        return timings, 0.0
    return cpu_kernels._decide("quantized-kernel", "GPUSHARE_CPU_QUANTIZED_KERNEL", ("blocks", "torch"), "blocks",
                               measure, "test kernel")


def test_a_busy_machine_is_not_measured_and_nothing_is_kept(fresh_cache, monkeypatch, caplog):
    _counters(1.5, monkeypatch)
    calls = []
    with caplog.at_level(logging.INFO, logger="gpushare.models"):
        assert _decide({"blocks": 2.0, "torch": 1.0}, calls) == "blocks"
    assert calls == [] and "not measured: other processes use 1.5 cores" in caplog.text
    assert cpu_verdicts.read_verdict("quantized-kernel") is None
    _counters(0.0, monkeypatch)  # quiet again: the same load keeps its answer, the next load measures
    assert _decide({"blocks": 2.0, "torch": 1.0}, calls) == "blocks" and calls == []
    cpu_kernels.measure_again_if_provisional()
    assert _decide({"blocks": 2.0, "torch": 1.0}, calls) == "torch" and calls == [1]
    kept = cpu_verdicts.read_verdict("quantized-kernel")
    assert kept.choice == "torch" and kept.build_key == "build-a" and kept.timings_us == {"blocks": 2e6, "torch": 1e6}


def test_a_gap_under_the_margin_keeps_the_default(fresh_cache, monkeypatch):
    _counters(0.0, monkeypatch)
    assert cpu_kernels.choose({"blocks": 1.00, "torch": 0.95}, "blocks") == "blocks"
    assert cpu_kernels.choose({"blocks": 1.00, "torch": 0.85}, "blocks") == "torch"
    assert cpu_kernels.choose({"blocks": 0.5, "torch": 1.0}, "blocks") == "blocks"
    assert _decide({"blocks": 1.0, "torch": 0.95}, []) == "blocks"


def test_a_verdict_of_another_kernels_build_is_measured_again(fresh_cache, monkeypatch):
    _counters(0.0, monkeypatch)
    calls = []
    assert _decide({"blocks": 2.0, "torch": 1.0}, calls) == "torch"
    cpu_kernels.forget_verdicts()
    assert _decide({"blocks": 1.0, "torch": 2.0}, calls) == "torch" and len(calls) == 1  # kept, same build
    cpu_kernels.forget_verdicts()
    monkeypatch.setattr(cpu_kernels, "kernels_build_key", lambda: "build-b")
    assert _decide({"blocks": 1.0, "torch": 2.0}, calls) == "blocks" and len(calls) == 2
    assert cpu_verdicts.read_verdict("quantized-kernel").build_key == "build-b"


def test_measurements_run_on_weights_larger_than_the_last_level_cache():
    total = cpu_kernels.stack_bytes()
    assert cpu_kernels.MIN_STACK_BYTES <= total <= cpu_kernels.MAX_STACK_BYTES
    shapes = cpu_kernels.layer_stack(total)
    assert sum(n * k for n, k in shapes) >= total and len(shapes) % len(cpu_kernels.LAYER_SHAPES) == 0
