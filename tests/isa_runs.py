"""A script run once per instruction set this machine builds the C++ kernels for (kernels/cpu_ops.py),
each in a process of its own (one build of the library a process), all at once: how test_cpu_isa and
test_lora_kernels get every ISA's outputs."""

import os
import subprocess
import sys
from pathlib import Path

import torch

from gpushare.kernels import cpu_ops


def outputs_by_isa(script: Path, folder: Path) -> dict:
    """``{isa: what script saved}`` for each runnable ISA: ``script OUT.pt`` runs with ``GPUSHARE_CPU_ISA``
    set (building, where this machine has no such build yet) and saves its outputs to OUT.pt."""
    env = {k: v for k, v in os.environ.items() if k != "GPUSHARE_KERNELS"}
    isas = cpu_ops.runnable_isas()
    runs = {isa: subprocess.Popen([sys.executable, str(script), str(folder / f"{isa}.pt")],
                                  env={**env, "GPUSHARE_CPU_ISA": isa}, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for isa in isas}
    for isa, run in runs.items():
        log, _ = run.communicate(timeout=1800)
        assert run.returncode == 0, f"{isa}: {log[-3000:]}"
    return {isa: torch.load(folder / f"{isa}.pt") for isa in isas}
