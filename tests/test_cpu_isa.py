"""The C++ CPU kernels built for each instruction set this machine runs (kernels/cpu_ops.py:
``GPUSHARE_CPU_ISA=avx512|avxvnni|avx2|portable``) give the portable build's bits: every kernel, on
the inputs of tests/isa_battery.py (float32, bfloat16 and int8 caches, head dims 24 to 128, windows,
soft caps, int8 and int4 weights, batched LoRA, the fused decode with and without adapters), at 1 and
2 threads. Each build runs in a process of its own (one build of the library a process); the ISA choice
and the build key are checked here."""

import logging
from pathlib import Path

import pytest
import torch

from gpushare.kernels import cpu_ops
from isa_runs import outputs_by_isa

pytestmark = pytest.mark.skipif(cpu_ops._compiler() is None, reason="no C++ compiler here")

ISAS = cpu_ops.runnable_isas()
# the block kernel each build must hold, on this CPU
KERNELS = {"avx512": "avx512-vnni" if "avx512_vnni" in cpu_ops.cpu_flags() else "avx2", "avxvnni": "avx-vnni",
           "avx2": "avx2", "portable": "portable"}
BATTERY = Path(__file__).with_name("isa_battery.py")


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict:
    """Each runnable ISA's battery outputs (built, if this machine has no such build yet, all at once)."""
    return outputs_by_isa(BATTERY, tmp_path_factory.mktemp("isa"))


def test_this_machine_runs_avx2_and_portable_at_least():
    assert "portable" in ISAS
    if {"avx2", "fma", "f16c"} <= cpu_ops.cpu_flags():
        assert "avx2" in ISAS


def test_each_build_is_its_isa_with_its_block_kernel(outputs):
    for isa, out in outputs.items():
        assert (out["isa"], out["block_kernel"]) == (isa, KERNELS[isa])


@pytest.mark.parametrize("isa", [isa for isa in ISAS if isa != "portable"])
def test_every_kernel_gives_the_portable_builds_bits(outputs, isa):
    portable, simd = outputs["portable"]["cases"], outputs[isa]["cases"]
    assert simd.keys() == portable.keys() and len(portable) > 500
    differ = [name for name in portable if not torch.equal(simd[name], portable[name])]
    assert not differ, f"{len(differ)} of {len(portable)} differ, e.g. {differ[:5]}"


def test_one_and_two_threads_give_the_same_bits(outputs):
    for isa, out in outputs.items():
        cases = out["cases"]
        one = [name for name in cases if name.endswith(" threads1")]
        assert one and all(torch.equal(cases[name], cases[name.replace(" threads1", " threads2")]) for name in one), isa


def test_the_block_kernel_and_its_in_build_portable_loop_agree(outputs):
    for isa, out in outputs.items():
        cases = out["cases"]
        pairs = [(name, name.replace(" threads", " in-build-portable threads")) for name in cases
                 if name.startswith("matmul") and "in-build" not in name]
        assert pairs and all(torch.equal(cases[a], cases[b]) for a, b in pairs), isa


def test_the_isa_is_the_best_the_flags_allow_unless_overridden(monkeypatch, caplog):
    vnni_laptop = {"avx2", "fma", "f16c", "avx_vnni"}  # an Intel hybrid CPU: no AVX-512
    if cpu_ops._x86():
        assert cpu_ops.runnable_isas(vnni_laptop) == ["avxvnni", "avx2", "portable"]
        assert cpu_ops.runnable_isas({"avx2", "fma", "f16c"}) == ["avx2", "portable"]
        assert cpu_ops.runnable_isas(vnni_laptop | {"avx512f", "avx512bw"})[0] == "avx512"
    assert cpu_ops.runnable_isas(set()) == ["portable"]
    try:
        for forced, chosen in [("", ISAS[0]), ("portable", "portable"), ("sse9", ISAS[0])]:
            monkeypatch.setenv("GPUSHARE_CPU_ISA", forced)
            cpu_ops.isa.cache_clear()
            with caplog.at_level(logging.WARNING, logger="gpushare.kernels"):
                assert cpu_ops.isa() == chosen
        assert "GPUSHARE_CPU_ISA=sse9: not one of avx512, avxvnni, avx2, portable" in caplog.text
    finally:
        cpu_ops.isa.cache_clear()


def test_each_isa_has_a_build_of_its_own():
    paths = {isa: cpu_ops.library_path(cpu_ops._compiler(), isa) for isa in cpu_ops.ISAS}
    assert len(set(paths.values())) == len(paths)
    assert all(path.name.startswith(f"cpu-ops-{isa}-") for isa, path in paths.items())
