"""The work of `gpushare node ...` (its command line: cli/node.py): topo, plan, apply, and
mps start|stop|status|env.

Each returns the exit status (0 ok, 1 a node tool failed or refused, 2 a usage or permission
problem) and takes a `NodeContext` (sysfs root, settings, runner, NVML module), so tests drive
them with fixture trees, recorded tool outputs and a fake NVML.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from gpushare.node import cpu_verdicts
from gpushare.node import mig as mig_layout
from gpushare.node import mps as mps_daemons
from gpushare.node.affinity import PinningPlan, plan_pinning
from gpushare.node.devices import WorkerPlanSet, plan_workers
from gpushare.node.gpu import NvmlReport, engine_targets, read_gpus
from gpushare.node.gpu_links import GpuLinks, read_gpu_links
from gpushare.node.runner import NodeError, SubprocessRunner
from gpushare.node.node_settings import NodeSettings
from gpushare.node.topology import Topology, format_cpulist, read_topology
from gpushare.node.tp_groups import TPGroupPlan, plan_tp_groups


@dataclass
class NodeContext:
    sysfs_root: str = "/"
    settings: NodeSettings = field(default_factory=NodeSettings)
    runner: object = field(default_factory=SubprocessRunner)
    nvml: object | None = None  # None: the real pynvml
    is_root: bool | None = None  # None: ask the OS
    allowed_cpus: list[int] | None = None  # None: this process's affinity when reading the live /sys
    devices: list[str] | None = None  # engine.devices; None: auto
    device: str = "auto"  # engine.device
    models: list = field(default_factory=list)  # config ModelEntry, tensor-parallel keys only (read_tensor_parallel_models)
    sleep: Callable[[float], None] = time.sleep

    def running_as_root(self) -> bool:
        return os.geteuid() == 0 if self.is_root is None else self.is_root

    def affinity(self) -> list[int] | None:
        if self.allowed_cpus is None and Path(self.sysfs_root).resolve() == Path("/"):
            return sorted(os.sched_getaffinity(0))
        return self.allowed_cpus


def topo(ctx: NodeContext, out, as_json: bool = False) -> int:
    try:
        topology, report, pinning = _survey(ctx)
    except ValueError as exc:
        print(f"gpushare node topo: {exc}", file=out)
        return 2
    mps_state, mps_notes = _mps_state(ctx, report)
    if as_json:
        cpuinfo = str(Path(ctx.sysfs_root) / "proc/cpuinfo")
        json.dump({"topology": _topology_json(topology), "nvml": asdict(report), "pinning": asdict(pinning),
                   "mps": [{"uuid": s.target.uuid, "running": s.running, "detail": s.detail} for s in mps_state],
                   "cpu_kernels": {"simd_flags": cpu_verdicts.simd_flags(cpuinfo),
                                   "verdicts": {name: v and asdict(v) for name, v in cpu_verdicts.kept_verdicts().items()}}},
                  out, indent=2)
        print(file=out)
        return 0
    _print_topology(topology, out)
    _print_gpus(topology, report, mps_state, mps_notes, out)
    _print_pinning(pinning, out)
    print("CPU kernels:", file=out)
    for line in cpu_verdicts.describe(str(Path(ctx.sysfs_root) / "proc/cpuinfo")):
        print(f"  {line}", file=out)
    return 0


def plan(ctx: NodeContext, out, as_json: bool = False) -> int:
    try:
        topology, report, _ = _survey(ctx)
        workers = plan_workers(ctx.devices, report, topology, ctx.settings, ctx.affinity(), ctx.device)
    except ValueError as exc:
        print(f"gpushare node plan: {exc}", file=out)
        return 2
    sections, notes, errors = {"mig": [], "mps": []}, {"mig": [], "mps": []}, []
    if report.cpu_mode:
        notes = {key: [f"{report.reason}: nothing to prepare"] for key in ("mig", "mps")}
        errors += _gpu_settings_without_gpu(ctx.settings)
    else:
        try:
            for gpu_plan in mig_layout.plan_mig(ctx.runner, ctx.settings.mig) if ctx.settings.mig else []:
                notes["mig"].append(f"GPU {gpu_plan.row.index} ({gpu_plan.row.name}): {gpu_plan.summary}")
                sections["mig"] += [c.shell() for c in gpu_plan.commands]
                errors += [gpu_plan.error] if gpu_plan.error else []
            if ctx.settings.mps.enabled:
                targets, rows, target_notes = mps_daemons.read_targets(ctx.runner, ctx.settings.mps.root)
                commands, start_notes = mps_daemons.plan_start(ctx.runner, targets, rows, ctx.settings.mps)
                sections["mps"] = [c.shell() for c in commands]
                notes["mps"] = target_notes + start_notes
                if sections["mig"]:
                    notes["mps"].insert(0, "MPS commands for the current MIG layout; "
                                           "`apply` starts daemons for the new one")
        except NodeError as exc:
            errors.append(str(exc))
    if not ctx.settings.mig and not report.cpu_mode:
        notes["mig"].append("node.mig is empty: MIG layouts are left as they are")
    if not ctx.settings.mps.enabled and not report.cpu_mode:
        notes["mps"].append("node.mps.enabled is false: MPS is left as it is")
    groups, tp_notes, refusals = _tp_groups(ctx, workers, report)
    if as_json:
        json.dump({"workers": asdict(workers), "mig": {"commands": sections["mig"], "notes": notes["mig"]},
                   "mps": {"commands": sections["mps"], "notes": notes["mps"]},
                   "tp_groups": [{"model": g.model, "workers": [w.name for w in g.workers], "link": g.link,
                                  "why": g.why} for g in groups], "errors": errors + refusals}, out, indent=2)
        print(file=out)
        return 1 if errors or refusals else 0
    _print_workers(workers, out)
    if groups or refusals:
        _print_tp_groups(groups, tp_notes, refusals, out)
    for key, title in (("mig", "# MIG (node.mig)"), ("mps", "# MPS (node.mps)")):
        print(f"\n{title}", file=out)
        for line in notes[key]:
            print(f"# {line}", file=out)
        for line in sections[key]:
            print(line, file=out)
    for error in errors:
        print(f"error: {error}", file=out)
    return 1 if errors or refusals else 0


def apply(ctx: NodeContext, out, as_json: bool = False) -> int:
    if not ctx.settings.manage:
        print("gpushare node apply: refused: node.manage is false in the config; set node.manage: true "
              "to let gpushare change this node's MIG and MPS settings", file=out)
        return 2
    if not ctx.running_as_root():
        print("gpushare node apply: refused: run it as root (MIG and compute-mode changes need root)", file=out)
        return 2
    report = read_gpus(ctx.nvml)
    done, errors = [], []
    if report.cpu_mode:
        done.append(f"{report.reason}: no MIG or MPS to apply")
        errors += _gpu_settings_without_gpu(ctx.settings)
    else:
        try:
            for result in mig_layout.apply_mig(ctx.runner, ctx.settings.mig) if ctx.settings.mig else []:
                state = "changed" if result.changed else "unchanged"
                done.append(f"MIG GPU {result.row.index}: {result.summary}" + ("" if result.error else f" ({state})"))
                errors += [result.error] if result.error else []
            if ctx.settings.mps.enabled:
                done += _mps_start(ctx)
        except NodeError as exc:
            errors.append(str(exc))
    done.append("CPU pinning is applied by the daemon when it starts (see `gpushare node plan`)")
    if as_json:
        json.dump({"done": done, "errors": errors}, out, indent=2)
        print(file=out)
    else:
        for line in done:
            print(line, file=out)
        for error in errors:
            print(f"error: {error}", file=out)
    return 1 if errors else 0


def mps(ctx: NodeContext, action: str, out, gpu: str | None = None, as_json: bool = False) -> int:
    if action in ("start", "stop") and not ctx.running_as_root():
        print(f"gpushare node mps {action}: refused: run it as root (it changes the GPU compute mode)", file=out)
        return 2
    report = read_gpus(ctx.nvml)
    if report.cpu_mode:
        print(f"gpushare node mps {action}: {report.reason}: MPS needs a GPU", file=out)
        return 1
    try:
        if action == "start":
            lines = _mps_start(ctx)
        elif action == "stop":
            targets, rows, _ = mps_daemons.read_targets(ctx.runner, ctx.settings.mps.root)
            commands = mps_daemons.stop(ctx.runner, targets, rows)
            lines = [f"ran: {c.shell()}" for c in commands] or ["MPS: nothing running; compute modes already DEFAULT"]
        elif action == "status":
            targets, _, notes = mps_daemons.read_targets(ctx.runner, ctx.settings.mps.root)
            states = [mps_daemons.status(ctx.runner, t) for t in targets]
            if as_json:
                json.dump([{"uuid": s.target.uuid, "gpu_index": s.target.gpu_index, "running": s.running,
                            "active_thread_percentage": s.active_thread_percentage, "pipe_dir": s.target.pipe_dir}
                           for s in states], out, indent=2)
                print(file=out)
                return 0
            lines = [f"{s.target.uuid} (GPU {s.target.gpu_index}): {s.detail}; pipe {s.target.pipe_dir}"
                     for s in states] + notes
        else:
            return _mps_env(ctx, out, gpu)
    except NodeError as exc:
        print(f"error: {exc}", file=out)
        return 1
    for line in lines:
        print(line, file=out)
    return 0


def _mps_start(ctx: NodeContext) -> list[str]:
    targets, rows, notes = mps_daemons.read_targets(ctx.runner, ctx.settings.mps.root)
    commands, start_notes = mps_daemons.start(ctx.runner, targets, rows, ctx.settings.mps, sleep=ctx.sleep)
    notes += start_notes
    ran = [f"ran: {c.shell()}" for c in commands]
    return ran + notes if ran else [f"MPS: {len(targets)} daemon(s) already running"] + notes


def _mps_env(ctx: NodeContext, out, gpu: str | None) -> int:
    targets, _, _ = mps_daemons.read_targets(ctx.runner, ctx.settings.mps.root)
    if gpu is not None:
        targets = [t for t in targets if gpu in (t.uuid, t.gpu_uuid, str(t.gpu_index))]
        if not targets:
            print(f"gpushare node mps env: no GPU or MIG instance matches {gpu!r}", file=out)
            return 1
    for target in targets:
        if len(targets) > 1:
            print(f"# {target.uuid} (GPU {target.gpu_index}); clients must not set CUDA_VISIBLE_DEVICES", file=out)
        for line in mps_daemons.env_lines(target):
            print(line, file=out)
    return 0


def _survey(ctx: NodeContext) -> tuple[Topology, NvmlReport, PinningPlan]:
    topology = read_topology(ctx.sysfs_root)
    report = read_gpus(ctx.nvml)
    pinning = plan_pinning(topology, ctx.settings, engines=engine_targets(report), allowed_cpus=ctx.affinity())
    return topology, report, pinning


def _tp_groups(ctx: NodeContext, workers: WorkerPlanSet, report: NvmlReport):
    """-> (groups, notes, refusals) for the models with tensor_parallel != 1; nvidia-smi topo -m
    runs only when one of them may take GPUs."""
    tp_models = [m for m in ctx.models if m.tensor_parallel != 1 or m.tensor_parallel_devices]
    links, notes, refusals = GpuLinks(), [], []
    if tp_models and not report.cpu_mode and any(w.torch_device == "cuda" for w in workers.workers):
        try:
            links = read_gpu_links(ctx.runner)
        except NodeError as exc:
            notes.append(f"GPU links unknown, taken as SYS: {exc}")
    groups = plan_tp_groups(ctx.models, workers, links, refusals=refusals) if tp_models else []
    return groups, notes, refusals


def _print_tp_groups(groups: list[TPGroupPlan], notes: list[str], refusals: list[str], out) -> None:
    print("\n# Tensor-parallel groups (models[].tensor_parallel): devices in rank order", file=out)
    for note in notes:
        print(f"# {note}", file=out)
    for group in groups:
        link = "one device" if len(group.workers) == 1 else f"worst link {group.link}"
        print(f"  {group.model}: {', '.join(w.name for w in group.workers)} ({link})", file=out)
        print(f"    {group.why}", file=out)
    for refusal in refusals:
        print(f"error: {refusal}", file=out)


def _mps_state(ctx: NodeContext, report: NvmlReport):
    if report.cpu_mode:
        return [], []
    try:
        targets, _, notes = mps_daemons.read_targets(ctx.runner, ctx.settings.mps.root)
    except NodeError as exc:
        return [], [f"MPS state unknown: {exc}"]
    return [mps_daemons.status(ctx.runner, t) for t in targets], notes


def _gpu_settings_without_gpu(settings: NodeSettings) -> list[str]:
    asked = [key for key, on in (("node.mig", bool(settings.mig)), ("node.mps.enabled", settings.mps.enabled)) if on]
    return [f"{key} is set, but this node has no usable GPU" for key in asked]


def _topology_json(topology: Topology) -> dict:
    data = asdict(topology)
    data["root"] = str(topology.root)
    return data


def _print_topology(topology: Topology, out) -> None:
    packages = len(topology.packages) or 1
    print(f"CPUs: {len(topology.cpus)} online ({format_cpulist(topology.cpus)}), "
          f"{len(topology.cores)} cores, {packages} package(s)", file=out)
    print(f"  core types: {topology.kind_source}", file=out)
    for kind, label in (("P", "P-cores"), ("E", "E-cores")):
        cores = [core for core in topology.cores if core.kind == kind]
        if cores:
            threads = sorted({len(core.cpus) for core in cores})
            print(f"  {label}: {len(cores)} (CPUs {format_cpulist(c for core in cores for c in core.cpus)}; "
                  f"{'/'.join(map(str, threads))} thread(s) per core)", file=out)
    print(f"  L3 domains: {'; '.join(format_cpulist(d) for d in topology.l3_domains) or 'unknown'}", file=out)
    nodes = "; ".join(f"node {n}: {format_cpulist(cpus)}" for n, cpus in topology.numa_nodes.items())
    print(f"NUMA: {nodes or 'no information'}", file=out)
    for note in topology.notes:
        print(f"  note: {note}", file=out)


def _print_gpus(topology: Topology, report: NvmlReport, mps_state, mps_notes, out) -> None:
    if report.cpu_mode:
        print(f"GPUs: {report.reason}", file=out)
        for device in topology.nvidia_gpus:
            print(f"  note: sysfs shows NVIDIA device {device.bus_id} ({device.device}), but NVML does not", file=out)
        return
    print(f"GPUs: {report.reason}", file=out)
    mps_by_uuid = {state.target.uuid: state for state in mps_state}
    for gpu in report.gpus:
        device = topology.pci_device(gpu.pci_bus_id)
        where = "not in sysfs" if device is None else (
            f"NUMA node {device.numa_node if device.numa_node is not None else 'unknown (-1)'}, "
            f"local CPUs {format_cpulist(device.local_cpus) if device.local_cpus else 'unknown'}")
        mig = {None: "no MIG", True: "MIG on", False: "MIG off"}[gpu.mig_enabled]
        if gpu.mig_pending is not None and gpu.mig_pending != gpu.mig_enabled:
            mig += " (change pending until reset or reboot)"
        capability = ".".join(map(str, gpu.compute_capability)) if gpu.compute_capability else "?"
        print(f"  GPU {gpu.index}: {gpu.name} {gpu.uuid} at {gpu.pci_bus_id}: {where}", file=out)
        print(f"    {gpu.memory_total_bytes / 2**30:.1f} GiB ({gpu.memory_used_bytes / 2**20:.0f} MiB used), "
              f"compute {capability}, compute mode {gpu.compute_mode}, {mig}, "
              f"{len(gpu.processes)} process(es), utilisation "
              f"{'n/a' if gpu.utilization_percent is None else f'{gpu.utilization_percent}%'}", file=out)
        for device in gpu.mig_devices:
            print(f"    MIG {device.profile} {device.uuid} (GPU instance {device.gpu_instance_id}, "
                  f"compute instance {device.compute_instance_id})", file=out)
        for uuid in [gpu.uuid] + [m.uuid for m in gpu.mig_devices]:
            if uuid in mps_by_uuid:
                print(f"    MPS {uuid}: {mps_by_uuid[uuid].detail}", file=out)
    for note in mps_notes:
        print(f"  note: {note}", file=out)


def _print_workers(plan: WorkerPlanSet, out) -> None:
    print("# Engine workers (engine.devices): one process each, started by the daemon", file=out)
    for worker in plan.workers:
        env = " ".join(f"{key}={value}" for key, value in worker.env.items()) or "no GPU"
        memory = "" if worker.memory_total_bytes is None else f", {worker.memory_total_bytes / 2**30:.1f} GiB"
        print(f"  {worker.name}: {env}; {_cpus_text(worker.cpus, worker.torch_threads, worker.numa_node, memory)}",
              file=out)
    _print_rest(plan.other_cpus, plan.notes, out)


def _print_pinning(pinning: PinningPlan, out, title: str = "CPU pinning:") -> None:
    print(title, file=out)
    for engine in pinning.engines:
        print(f"  engine {engine.engine}: {_cpus_text(engine.cpus, engine.torch_threads, engine.numa_node)}", file=out)
    _print_rest(pinning.other_cpus, pinning.notes, out)


def _cpus_text(cpus: list[int], torch_threads: int, numa_node: int | None, extra: str = "") -> str:
    node = "" if numa_node is None else f", NUMA node {numa_node}"
    return f"CPUs {format_cpulist(cpus) or 'none'} ({torch_threads} torch threads{node}{extra})"


def _print_rest(other_cpus: list[int], notes: list[str], out) -> None:
    print(f"  HTTP and tokenisation: CPUs {format_cpulist(other_cpus)}", file=out)
    for note in notes:
        print(f"  note: {note}", file=out)
