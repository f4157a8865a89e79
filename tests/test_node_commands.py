"""`gpushare node ...`: argparse wiring, and topo/plan/apply/mps over fixture trees, a fake NVML
and recorded tool outputs; `node topo` on this machine."""

import argparse
import io
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "node"))
from node_fakes import (XEON_GPUS, FakeGpu, FakeNvml, Recorded, ReplayRunner, h100_node_gpus, recorded,  # noqa: E402
                        sysfs_root)

from gpushare.cli import node as node_cli  # noqa: E402
from gpushare.node import commands  # noqa: E402
from gpushare.node.commands import NodeContext  # noqa: E402
from gpushare.node.gpu import read_gpus  # noqa: E402
from gpushare.node.node_settings import MpsSettings, NodeSettings  # noqa: E402

QUERY = ("nvidia-smi --query-gpu=index,uuid,name,pci.bus_id,mig.mode.current,mig.mode.pending,compute_mode "
         "--format=csv,noheader")
H100 = "GPU-b4895dbf-9350-2524-a89b-98161ddd9fe4"
NO_NVML = 12  # NVML_ERROR_LIBRARY_NOT_FOUND
CPU_MODE = "CPU mode: NVML is not available (NVML Shared Library Not Found); no NVIDIA driver on this machine"


def parser():
    root = argparse.ArgumentParser(prog="gpushare")
    node_cli.add_node_parser(root.add_subparsers(dest="command", required=True))
    return root


def run(function, ctx, *args, **kwargs):
    out = io.StringIO()
    code = function(ctx, *args, out=out, **kwargs) if args else function(ctx, out, **kwargs)
    return code, out.getvalue()


def mps_dirs(uuid):
    return f"CUDA_MPS_PIPE_DIRECTORY=/run/gpushare/mps/{uuid}/pipe CUDA_MPS_LOG_DIRECTORY=/run/gpushare/mps/{uuid}/log"


def xeon_context(**settings):
    """The dual-socket tree with the four H100 of the 8xH100 capture, no MPS daemon running."""
    rows = "".join(f"{i}, {g.uuid}, {g.name}, {g.bus_id}, Disabled, Disabled, Default\n"
                   for i, g in enumerate(XEON_GPUS))
    listing = "".join(f"GPU {i}: {g.name} (UUID: {g.uuid})\n" for i, g in enumerate(XEON_GPUS))
    script = {QUERY: Recorded(rows), "nvidia-smi -L": Recorded(listing)}
    for gpu in XEON_GPUS:
        script[f"echo get_default_active_thread_percentage | {mps_dirs(gpu.uuid)} nvidia-cuda-mps-control"] = \
            recorded("mps-control_no-daemon.txt")
    return NodeContext(sysfs_root=str(sysfs_root("xeon-2s-4xh100")), settings=NodeSettings(**settings),
                       runner=ReplayRunner(script), nvml=FakeNvml(XEON_GPUS), is_root=True)


def test_parser_wiring():
    args = parser().parse_args(["node", "topo", "--sysfs-root", "/x", "--config", "c.yaml", "--json"])
    assert (args.node_command, args.sysfs_root, args.config, args.json) == ("topo", "/x", "c.yaml", True)
    args = parser().parse_args(["node", "mps", "env", "--gpu", "0"])
    assert (args.node_command, args.action, args.gpu, args.sysfs_root) == ("mps", "env", "0", "/")
    for name in ("topo", "plan", "apply"):
        assert callable(parser().parse_args(["node", name]).func)


def test_topo_on_this_machine(capsys):
    args = parser().parse_args(["node", "topo"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    report = read_gpus()
    assert out.startswith("CPUs: ") and "CPU pinning:" in out
    # the kernels' SIMD paths follow these flags, and the kept verdicts say what was measured
    flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    kernels = out[out.index("CPU kernels:"):].splitlines()
    assert kernels[1].startswith("  SIMD flags: ") and ("avx2" in kernels[1].split()) == ("avx2" in flags)
    assert kernels[2].startswith("  quantized linears: ") and kernels[3].startswith("  int8 prefill rows")
    if report.cpu_mode:  # this development machine: no NVIDIA driver
        assert f"GPUs: {report.reason}" in out and "CPU mode" in out
        assert "  engine cpu: CPUs " in out
    else:
        assert all(gpu.uuid in out for gpu in report.gpus)


def test_topo_dual_socket_server():
    code, out = run(commands.topo, xeon_context())
    assert code == 0
    lines = out.splitlines()
    assert lines[:5] == ["CPUs: 32 online (0-31), 16 cores, 2 package(s)",
                         "  core types: cpufreq/cpuinfo_max_freq: one core type",
                         "  P-cores: 16 (CPUs 0-31; 2 thread(s) per core)",
                         "  L3 domains: 0-7,16-23; 8-15,24-31",
                         "NUMA: node 0: 0-7,16-23; node 1: 8-15,24-31"]
    assert lines[5:9] == [
        "GPUs: 4 GPU(s), NVIDIA driver 565.57.01",
        "  GPU 0: NVIDIA H100 80GB HBM3 GPU-b42dd28e-ffdd-8720-1df0-98bd8cdc05b1 at 00000000:18:00.0: NUMA node 0, "
        "local CPUs 0-7,16-23",
        "    79.6 GiB (1 MiB used), compute 9.0, compute mode Default, MIG off, 0 process(es), utilisation 0%",
        "    MPS GPU-b42dd28e-ffdd-8720-1df0-98bd8cdc05b1: not running"]
    pinning = lines.index("CPU pinning:")
    assert lines[pinning:pinning + 7] == [
        "CPU pinning:",
        "  engine GPU-b42dd28e-ffdd-8720-1df0-98bd8cdc05b1: CPUs 0-3 (4 torch threads, NUMA node 0)",
        "  engine GPU-7c3cadbd-17e5-0913-f69b-c618122ea0cd: CPUs 4-7 (4 torch threads, NUMA node 0)",
        "  engine GPU-72be6e5d-3c1b-0d37-98ac-d3ef159f2589: CPUs 8-11 (4 torch threads, NUMA node 1)",
        "  engine GPU-52378fbc-3124-3895-13b6-1dd179563e0f: CPUs 12-15 (4 torch threads, NUMA node 1)",
        "  HTTP and tokenisation: CPUs 16-31",
        "  note: no spare core: HTTP and tokenisation run on the SMT siblings of engine cores"]
    code, out = run(commands.topo, xeon_context(), as_json=True)
    data = json.loads(out)
    assert [e["cpus"] for e in data["pinning"]["engines"]] == [list(range(i, i + 4)) for i in (0, 4, 8, 12)]
    assert [g["uuid"] for g in data["nvml"]["gpus"]] == [g.uuid for g in XEON_GPUS]


def test_topo_hybrid_without_driver_says_cpu_mode():
    ctx = NodeContext(sysfs_root=str(sysfs_root("i9-12900k-rtx4090")), runner=ReplayRunner({}),
                      nvml=FakeNvml([], init_error=NO_NVML))
    code, out = run(commands.topo, ctx)
    assert code == 0
    assert f"GPUs: {CPU_MODE}" in out
    assert "  note: sysfs shows NVIDIA device 0000:01:00.0 (0x2684), but NVML does not" in out
    assert ("  engine cpu: CPUs 0,2,4,6,8,10,12,14 (8 torch threads, NUMA node 0)\n"
            "  HTTP and tokenisation: CPUs 16-23") in out


def h100_context(settings, script, is_root=True, query_file="h100_query-gpu_mig-disabled.csv.txt"):
    gpu = FakeGpu("NVIDIA H100 80GB HBM3", H100, "00000000:42:00.0", 81559, 0, (9, 0))
    return NodeContext(sysfs_root=str(sysfs_root("vm-p100")), settings=settings, is_root=is_root,
                       runner=ReplayRunner({QUERY: recorded(query_file), **script}), nvml=FakeNvml([gpu]))


def test_plan_prints_the_mps_commands_apply_would_run():
    get = f"echo get_default_active_thread_percentage | {mps_dirs(H100)} nvidia-cuda-mps-control"
    script = {"nvidia-smi -L": recorded("h100_nvidia-smi-L_whole-gpu.txt"), get: recorded("mps-control_no-daemon.txt")}
    settings = NodeSettings(mps=MpsSettings(enabled=True, active_thread_percentage=50, pinned_device_mem_limit="40G"))
    ctx = h100_context(settings, script)
    code, out = run(commands.plan, ctx)
    assert code == 0
    assert out.split("# MPS (node.mps)\n")[1] == (
        f"nvidia-smi -i {H100} -c EXCLUSIVE_PROCESS\n"
        f"mkdir -p /run/gpushare/mps/{H100}/pipe /run/gpushare/mps/{H100}/log\n"
        f"CUDA_VISIBLE_DEVICES={H100} {mps_dirs(H100)} nvidia-cuda-mps-control -d\n"
        f"echo 'set_default_active_thread_percentage 50' | {mps_dirs(H100)} nvidia-cuda-mps-control\n"
        f"echo 'set_default_device_pinned_mem_limit 0 40G' | {mps_dirs(H100)} nvidia-cuda-mps-control\n")
    assert ctx.runner.calls == [QUERY, "nvidia-smi -L", get]  # planning ran only reads


def test_plan_prints_the_mig_commands():
    script = {"nvidia-smi mig -i 0 -lgip": recorded("h100-80gb_nvidia-smi-mig-lgip.txt"),
              "nvidia-smi mig -i 0 -lgi": recorded("h100-80gb_nvidia-smi-mig-lgi_7x1g.10gb.txt"),
              "nvidia-smi mig -i 0 -lci": recorded("h100-80gb_nvidia-smi-mig-lci_7x1g.10gb.txt")}
    ctx = h100_context(NodeSettings(mig={"all": ["3g.40gb", "3g.40gb"]}), script,
                       query_file="h100_query-gpu_mig-enabled.csv.txt")
    code, out = run(commands.plan, ctx)
    assert code == 0
    assert out.split("# MIG (node.mig)\n")[1].split("\n# MPS")[0] == (
        "# GPU 0 (NVIDIA H100 80GB HBM3): 7× 1g.10gb -> 2× 3g.40gb\n"
        "nvidia-smi mig -i 0 -dci\nnvidia-smi mig -i 0 -dgi\nnvidia-smi mig -i 0 -cgi 9,9 -C\n")


def test_apply_refuses_without_manage_or_root():
    code, out = run(commands.apply, h100_context(NodeSettings(manage=False), {}))
    assert code == 2 and out.startswith("gpushare node apply: refused: node.manage is false in the config")
    code, out = run(commands.apply, h100_context(NodeSettings(manage=True), {}, is_root=False))
    assert (code, out) == (2, "gpushare node apply: refused: run it as root (MIG and compute-mode changes need root)\n")


def test_apply_then_apply_again():
    script = {"nvidia-smi -i 0 -mig 1": recorded("h200-141gb_nvidia-smi-mig-enable_ok.txt"),
              "nvidia-smi mig -i 0 -lgip": recorded("h200-141gb_nvidia-smi-mig-lgip_composed-gpu0.txt"),
              "nvidia-smi mig -i 0 -lgi": [recorded("nvidia-smi-mig-lgi_none.txt"),
                                           recorded("h200-141gb_nvidia-smi-mig-lgi_2x3g.71gb.txt")],
              "nvidia-smi mig -i 0 -lci": [recorded("nvidia-smi-mig-lci_none.txt"),
                                           recorded("h200-141gb_nvidia-smi-mig-lci_2x3g.71gb.txt")],
              "nvidia-smi mig -i 0 -cgi 9,9 -C": recorded("h200-141gb_nvidia-smi-mig-cgi-9-9-C_ok.txt")}
    ctx = h100_context(NodeSettings(manage=True, mig={"all": ["3g.71gb", "3g.71gb"]}), script,
                       query_file="h200_query-gpu_mig-disabled.csv.txt")
    ctx.runner.script[QUERY].append(recorded("h200_query-gpu_mig-enabled.csv.txt"))
    code, out = run(commands.apply, ctx)
    assert (code, out) == (0, "MIG GPU 0: enable MIG, then create 2× 3g.71gb (changed)\n"
                              "CPU pinning is applied by the daemon when it starts (see `gpushare node plan`)\n")
    code, out = run(commands.apply, ctx)
    assert (code, out.splitlines()[0]) == (0, "MIG GPU 0: 2× 3g.71gb, as configured (unchanged)")


def test_apply_reports_a_failure_with_exit_1():
    script = {"nvidia-smi mig -i 0 -lgip": recorded("gh200-96gb_nvidia-smi-mig-lgip.txt"),
              "nvidia-smi mig -i 0 -lgi": recorded("nvidia-smi-mig-lgi_none.txt"),
              "nvidia-smi mig -i 0 -lci": recorded("nvidia-smi-mig-lci_none.txt"),
              "nvidia-smi mig -i 0 -cgi 15,15,15 -C":
                  recorded("gh200-96gb_nvidia-smi-mig-cgi_in-use-by-another-client.txt")}
    ctx = h100_context(NodeSettings(manage=True, mig={"0": ["1g.24gb"] * 3}), script,
                       query_file="gh200_query-gpu_mig-enabled.csv.txt")
    code, out = run(commands.apply, ctx)
    assert code == 1
    assert "error: GPU 0 (00000009:01:00.0): creating GPU instances failed: In use by another client." in out


def test_apply_and_mps_in_cpu_mode():
    ctx = NodeContext(sysfs_root=str(sysfs_root("i9-12900k-rtx4090")), settings=NodeSettings(manage=True),
                      runner=ReplayRunner({}), nvml=FakeNvml([], init_error=NO_NVML), is_root=True)
    code, out = run(commands.apply, ctx)
    assert (code, out.splitlines()[0]) == (0, f"{CPU_MODE}: no MIG or MPS to apply")
    ctx.settings = NodeSettings(manage=True, mig={"all": ["3g.71gb"]})
    code, out = run(commands.apply, ctx)
    assert code == 1 and "error: node.mig is set, but this node has no usable GPU" in out
    code, out = run(commands.mps, ctx, "status")
    assert (code, out) == (1, f"gpushare node mps status: {CPU_MODE}: MPS needs a GPU\n")
    assert ctx.runner.calls == []


def test_mps_env_status_and_refusal():
    get = f"echo get_default_active_thread_percentage | {mps_dirs(H100)} nvidia-cuda-mps-control"
    script = {"nvidia-smi -L": recorded("h100_nvidia-smi-L_whole-gpu.txt"),
              get: recorded("mps-control_get-percentage_50.txt")}
    code, out = run(commands.mps, h100_context(NodeSettings(), script), "env", gpu="0")
    assert (code, out) == (0, f"export CUDA_MPS_PIPE_DIRECTORY=/run/gpushare/mps/{H100}/pipe\n"
                              f"export CUDA_MPS_LOG_DIRECTORY=/run/gpushare/mps/{H100}/log\n")
    code, out = run(commands.mps, h100_context(NodeSettings(), script), "env", gpu="7")
    assert (code, out) == (1, "gpushare node mps env: no GPU or MIG instance matches '7'\n")
    code, out = run(commands.mps, h100_context(NodeSettings(), script), "status", as_json=True)
    assert json.loads(out) == [{"uuid": H100, "gpu_index": 0, "running": True, "active_thread_percentage": 50.0,
                                "pipe_dir": f"/run/gpushare/mps/{H100}/pipe"}]
    code, out = run(commands.mps, h100_context(NodeSettings(), script, is_root=False), "start")
    assert code == 2 and "refused: run it as root" in out


def test_mps_start_and_stop_print_what_they_ran():
    get = f"echo get_default_active_thread_percentage | {mps_dirs(H100)} nvidia-cuda-mps-control"
    start = f"CUDA_VISIBLE_DEVICES={H100} {mps_dirs(H100)} nvidia-cuda-mps-control -d"
    mkdir = f"mkdir -p /run/gpushare/mps/{H100}/pipe /run/gpushare/mps/{H100}/log"
    silent = recorded("mps-control_silent.txt")
    script = {"nvidia-smi -L": recorded("h100_nvidia-smi-L_whole-gpu.txt"), mkdir: silent, start: silent,
              get: [recorded("mps-control_no-daemon.txt"), recorded("mps-control_get-percentage_100.txt")],
              f"nvidia-smi -i {H100} -c EXCLUSIVE_PROCESS": recorded("nvidia-smi-c-exclusive-process_ok.txt")}
    code, out = run(commands.mps, h100_context(NodeSettings(), script), "start")
    assert (code, out) == (0, f"ran: nvidia-smi -i {H100} -c EXCLUSIVE_PROCESS\nran: {mkdir}\nran: {start}\n")
    script = {"nvidia-smi -L": recorded("h100_nvidia-smi-L_whole-gpu.txt"), get: recorded("mps-control_no-daemon.txt")}
    code, out = run(commands.mps, h100_context(NodeSettings(), script), "stop")
    assert (code, out) == (0, "MPS: nothing running; compute modes already DEFAULT\n")


def test_config_file_errors_name_the_key(tmp_path, capsys):
    config = tmp_path / "gpushare.yaml"
    config.write_text("node:\n  cpus: [0, oops]\n")
    args = parser().parse_args(["node", "plan", "--config", str(config)])
    assert args.func(args) == 2
    assert "node.cpus: expected a list of CPU numbers" in capsys.readouterr().err
    config.write_text("node:\n  cpus: '2-3'\n")
    args = parser().parse_args(["node", "plan", "--config", str(config), "--json",
                                "--sysfs-root", str(sysfs_root("i9-12900k-rtx4090"))])
    args.func(args)
    notes = json.loads(capsys.readouterr().out)["workers"]["notes"]
    assert notes[0] == "node.cpus overrides the automatic choice: engines run on CPUs 2-3"


def test_plan_prints_one_line_per_engine_worker():
    gpus = h100_node_gpus()
    ctx = NodeContext(sysfs_root=str(sysfs_root("xeon-2s-8xh100")), runner=ReplayRunner({}), nvml=FakeNvml(gpus),
                      devices=["cuda:0", "cuda:4", "cpu:12-15"])
    code, out = run(commands.plan, ctx)
    assert code == 0
    assert out.split("\n# MIG")[0].splitlines() == [
        "# Engine workers (engine.devices): one process each, started by the daemon",
        f"  cuda:0: CUDA_VISIBLE_DEVICES={gpus[0].uuid}; CPUs 0-7 (8 torch threads, NUMA node 0, 79.6 GiB)",
        f"  cuda:4: CUDA_VISIBLE_DEVICES={gpus[4].uuid}; CPUs 8-11 (4 torch threads, NUMA node 1, 79.6 GiB)",
        "  cpu:12-15: no GPU; CPUs 12-15 (4 torch threads, NUMA node 1)",
        "  HTTP and tokenisation: CPUs 16-31",
        "  note: no spare core: HTTP and tokenisation run on the SMT siblings of engine cores"]
    ctx.devices = ["cuda:8"]
    code, out = run(commands.plan, ctx)
    assert code == 2 and out.startswith("gpushare node plan: engine.devices: cuda:8: no such device; NVML sees ")


def test_plan_reads_engine_devices_from_the_config(tmp_path, capsys):
    config = tmp_path / "gpushare.yaml"
    config.write_text("engine:\n  devices: [cuda:0, gpu1]\n")
    args = parser().parse_args(["node", "plan", "--config", str(config)])
    assert args.func(args) == 2
    assert "engine.devices[1]: 'gpu1' is not a device; expected 'cuda:N'" in capsys.readouterr().err


def test_plan_shows_the_tensor_parallel_groups_and_refusals():
    from gpushare.settings.settings import ModelEntry

    ctx = xeon_context()
    ctx.runner.script["nvidia-smi topo -m"] = [recorded("4gpu-mixed-pcie_nvidia-smi-topo-m.txt")]
    ctx.models = [ModelEntry("small", "", tensor_parallel=2), ModelEntry("plain", ""),
                  ModelEntry("big", "", tensor_parallel=4)]
    code, out = run(commands.plan, ctx)
    assert code == 1
    section = out.split("# Tensor-parallel groups (models[].tensor_parallel): devices in rank order\n")[1]
    assert section.split("\n\n# MIG")[0].splitlines() == [
        "  small: cuda:0, cuda:1 (worst link PIX)",
        "    cuda:0, cuda:1: the best-linked 2 GPUs of this node, every pair joined by at least one PCIe switch (PIX); "
        "none is in another tensor-parallel group.",
        "error: models[2] big: the best-linked 4 GPUs (cuda:0, cuda:1, cuda:2, cuda:3) are joined only by the "
        "inter-socket link (SYS): all-reduces over the inter-socket link run several times slower than over NVLink "
        "or a PCIe switch, after every split layer; set models[2].tensor_parallel_cross_numa: true to accept"]
    assert "nvidia-smi topo -m" in ctx.runner.calls
    code, out = run(commands.plan, ctx, as_json=True)
    data = json.loads(out)
    assert code == 1
    assert data["tp_groups"] == [{"model": "small", "workers": ["cuda:0", "cuda:1"], "link": "PIX",
                                  "why": section.splitlines()[1].strip()}]
    assert data["errors"][0].startswith("models[2] big: the best-linked 4 GPUs")


def test_plan_from_a_config_whose_model_files_are_elsewhere(tmp_path, capsys):
    """The CPU case: two CPU workers on one NUMA node; the model path need not exist here."""
    config = tmp_path / "gpushare.yaml"
    config.write_text("engine:\n  devices: [cpu:0, cpu:1]\n"
                      "models:\n  - name: m\n    path: /nowhere/m.gguf\n    tensor_parallel: 2\n")
    args = parser().parse_args(["node", "plan", "--config", str(config), "--sysfs-root", str(sysfs_root("vm-p100"))])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "  m: cpu:0, cpu:1 (worst link NUMA-local)\n" in out
