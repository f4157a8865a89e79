"""The ``env`` and ``node`` parts of benchmarks/gpu_check.py.

env: Python, torch, Triton, CUDA and driver versions, the card, which of gpushare's dependencies
import here (a lent machine has no network: a missing one is carried as a wheel, see
benchmarks/README-gpu-check.md), and ``nvidia-smi``'s own table.
node: read-only probes through gpushare's own node code: ``read_gpus()`` (NVML), the raw NVML values
it and the health watch read, and the outputs of the nvidia-smi / nvidia-cuda-mps-control commands
``gpushare/node`` runs (listing, query, MIG listings, topology, MPS state). Each output is kept in the
recorded-output shape of tests/fixtures/node/nvidia (``# source:``/``# command:``/``# exit:`` lines,
then the output); ``gpu_check.py --fixtures RESULTS DIR`` writes them out as files for node/'s tests.
Nothing here changes the GPU's state: no MIG, compute-mode or MPS command that writes is run.
"""

import dataclasses
import datetime
import importlib
import platform
import re

import torch

from gpu_check_common import DEVICE

# import name -> distribution, for gpushare's dependencies (pyproject.toml)
DEPENDENCIES = {"aiohttp": "aiohttp", "orjson": "orjson", "gguf": "gguf", "tokenizers": "tokenizers",
                "llguidance": "llguidance", "safetensors": "safetensors", "pynvml": "nvidia-ml-py",
                "yaml": "pyyaml", "jinja2": "jinja2", "numpy": "numpy", "psutil": "psutil",
                "prometheus_client": "prometheus-client", "jsonschema": "jsonschema",
                "huggingface_hub": "huggingface_hub", "transformers": "transformers"}


def part_env(report):
    import triton

    report.line(f"  Python {platform.python_version()} on {platform.machine()}, torch {torch.__version__}, "
                f"triton {triton.__version__}, CUDA {torch.version.cuda}")
    report.data["versions"] = {"python": platform.python_version(), "torch": torch.__version__,
                               "triton": triton.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        card = (f"{props.name}, {props.total_memory / 2**30:.1f} GiB, sm_{props.major}{props.minor}, "
                f"{props.multi_processor_count} SMs")
        report.data["card"] = card
        report.line(f"  {card}")
    else:
        report.line(f"  no CUDA device visible{' (the dry run)' if DEVICE != 'cuda' else ''}")
    found, missing = {}, []
    for module, dist in DEPENDENCIES.items():
        try:
            found[dist] = getattr(importlib.import_module(module), "__version__", "present")
        except Exception as e:  # ImportError, or a broken install
            missing.append(dist)
            found[dist] = f"MISSING ({type(e).__name__})"
    report.data["dependencies"] = found
    report.line("  dependencies: " + ", ".join(f"{k} {v}" for k, v in found.items()))
    if missing:
        # gguf (GGUF files), llguidance and jsonschema (structured output) are imported only where used
        report.line(f"  missing here: {', '.join(missing)}"
                    + ("; the daemon imports orjson: carry its wheel (benchmarks/README-gpu-check.md)"
                       if "orjson" in missing else ""))
    result = run_command(("nvidia-smi",))
    report.data["nvidia_smi"] = result.output
    for text in result.output.splitlines():
        report.line("  | " + text)


def run_command(argv, input_text=None):
    from gpushare.node.runner import Command, SubprocessRunner

    return SubprocessRunner().run(Command(tuple(argv), (), input_text), timeout_s=20)


def node_commands():
    """The read-only commands gpushare/node runs, built by its own builders."""
    from gpushare.node.gpu_links import topo_command
    from gpushare.node.mps import CONTROL
    from gpushare.node.nvsmi import list_command, mig_command, query_command
    from gpushare.node.runner import Command

    return {"nvidia-smi-L": list_command(), "query-gpu.csv": query_command(), "nvidia-smi-topo-m": topo_command(),
            "nvidia-smi-mig-lgip": mig_command(0, "-lgip"), "nvidia-smi-mig-lgi": mig_command(0, "-lgi"),
            "nvidia-smi-mig-lci": mig_command(0, "-lci"),
            "mps-control_get-percentage": Command((CONTROL,), (), "get_default_active_thread_percentage")}


def slug(text):
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")


def recorded_output(card, result, when):
    """One command's output in tests/fixtures/node/nvidia's shape."""
    head = [f"# source: captured on a lent {card} by benchmarks/gpu_check.py, {when}",
            f"# command: {result.command.shell()}", f"# exit: {result.returncode}"]
    return "\n".join(head) + "\n" + result.output


def part_node(report):
    from gpushare.node.runner import NodeError

    card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "machine without a GPU (dry run)"
    when = datetime.date.today().isoformat()
    prefix = slug(card.replace("NVIDIA", ""))
    recorded = report.data.setdefault("recorded", {})
    for label, command in node_commands().items():
        result = run_command(command.argv, command.input_text)
        recorded[f"{prefix}_{label}.txt"] = recorded_output(card, result, when)
        first = result.output.strip().splitlines()[:1]
        report.line(f"  `{command.shell()}`: exit {result.returncode}, {len(result.output.splitlines())} lines "
                    f"{first[0][:100] if first else ''}")
    nvml_values(report, recorded, prefix, card, when)
    try:
        from gpushare.node.gpu import read_gpus

        gpus = read_gpus()
        report.data["read_gpus"] = dataclasses.asdict(gpus)
        report.line(f"  read_gpus(): available={gpus.available}, {gpus.reason}; "
                    f"{[(g.name, g.compute_capability, g.mig_enabled) for g in gpus.gpus]}")
    except (ImportError, NodeError) as e:
        report.line(f"  read_gpus(): {type(e).__name__}: {e}")


def nvml_values(report, recorded, prefix, card, when):
    """The raw answer of each NVML call gpushare makes for GPU 0 (or the error's class name): the
    values a FakeNvml of this card would carry."""
    import json

    try:
        import pynvml as nvml
        nvml.nvmlInit()
    except Exception as e:  # no library, no driver: recorded as such
        report.line(f"  NVML: {type(e).__name__}: {e}")
        recorded[f"{prefix}_nvml.json"] = json.dumps({"error": f"{type(e).__name__}: {e}"})
        return
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(0)
        calls = {
            "nvmlSystemGetDriverVersion": lambda: nvml.nvmlSystemGetDriverVersion(),
            "nvmlDeviceGetCount": lambda: nvml.nvmlDeviceGetCount(),
            "nvmlDeviceGetName": lambda: nvml.nvmlDeviceGetName(handle),
            "nvmlDeviceGetUUID": lambda: nvml.nvmlDeviceGetUUID(handle),
            "nvmlDeviceGetPciInfo.busId": lambda: nvml.nvmlDeviceGetPciInfo(handle).busId,
            "nvmlDeviceGetMemoryInfo": lambda: {k: getattr(nvml.nvmlDeviceGetMemoryInfo(handle), k)
                                                for k in ("total", "free", "used")},
            "nvmlDeviceGetCudaComputeCapability": lambda: nvml.nvmlDeviceGetCudaComputeCapability(handle),
            "nvmlDeviceGetComputeMode": lambda: nvml.nvmlDeviceGetComputeMode(handle),
            "nvmlDeviceGetMigMode": lambda: nvml.nvmlDeviceGetMigMode(handle),
            "nvmlDeviceGetMaxMigDeviceCount": lambda: nvml.nvmlDeviceGetMaxMigDeviceCount(handle),
            "nvmlDeviceGetComputeRunningProcesses": lambda: [
                (p.pid, p.usedGpuMemory) for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)],
            "nvmlDeviceGetUtilizationRates": lambda: {k: getattr(nvml.nvmlDeviceGetUtilizationRates(handle), k)
                                                      for k in ("gpu", "memory")},
            "nvmlDeviceGetTotalEccErrors(uncorrected, volatile)": lambda: nvml.nvmlDeviceGetTotalEccErrors(
                handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC),
            "nvmlDeviceGetRetiredPagesPendingStatus": lambda: nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle),
            "nvmlDeviceGetRemappedRows": lambda: nvml.nvmlDeviceGetRemappedRows(handle),
        }
        values = {}
        for name, call in calls.items():
            try:
                value = call()
                values[name] = value.decode() if isinstance(value, bytes) else value
            except Exception as e:  # NVMLError_NotSupported and kin: the answer itself
                values[name] = f"raises {type(e).__name__}"
        values["_source"] = f"captured on a lent {card} by benchmarks/gpu_check.py, {when}"
        recorded[f"{prefix}_nvml.json"] = json.dumps(values, indent=1, default=str)
        report.line(f"  NVML: {len(values) - 1} calls recorded, e.g. MIG mode {values['nvmlDeviceGetMigMode']}, "
                    f"compute mode {values['nvmlDeviceGetComputeMode']}")
    finally:
        nvml.nvmlShutdown()
