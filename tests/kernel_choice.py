"""Tests' choice of the CPU's quantized-linear kernel, whatever this machine's kept verdict."""

import pytest

from gpushare.models.cpu_kernels import forget_verdicts


def use_cpu_kernel(kernel: str, monkeypatch, request) -> None:
    """Quantized weights on the CPU ``kernel`` ("blocks" or "torch") for this test."""
    from gpushare.kernels import cpu_ops

    if kernel == "blocks" and not cpu_ops.loaded():
        pytest.skip("the C++ kernels do not build here")
    monkeypatch.setenv("GPUSHARE_CPU_QUANTIZED_KERNEL", kernel)
    forget_verdicts()
    request.addfinalizer(forget_verdicts)
