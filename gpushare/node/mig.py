"""MIG layout: make each GPU's GPU instances match `node.mig`, idempotently.

The current layout is read with `nvidia-smi mig -lgip/-lgi/-lci` and compared with the
desired one by profile counts (instance ids and placements do not matter). To change it,
as NVIDIA's mig-parted does: enable MIG mode, destroy compute instances, then GPU
instances, then create all GPU instances (each with its default compute instance) in one
`-cgi ... -C`, trying other orders when the GPU answers "Insufficient Resources" (placement
depends on order) and clearing what a failed attempt left behind. A MIG mode change that
stays pending (the GPU is in use, or a VM without reset) is reported; gpushare never resets
a GPU. `plan_mig` only reads; `apply_mig` changes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from itertools import permutations

from gpushare.node.nvsmi import (
    NVIDIA_SMI, ComputeInstance, GiProfile, GpuInstance, GpuRow, created_compute_instances,
    created_gpu_instances, failure_reason, mig_command, nothing_listed, parse_compute_instances,
    parse_gi_profiles, parse_gpu_instances, pending_mode_change, read_gpu_rows,
)
from gpushare.node.runner import Command, CommandResult, NodeError

MAX_CREATION_ORDERS = 24  # 7 distinct profiles have 5040 orders; a layout that fits fits early


class MigError(NodeError):
    pass


class MigPending(MigError):
    """A MIG mode change waits for a GPU reset or reboot."""


@dataclass
class MigState:
    row: GpuRow
    profiles: list[GiProfile] = field(default_factory=list)
    instances: list[GpuInstance] = field(default_factory=list)
    compute_instances: list[ComputeInstance] = field(default_factory=list)

    def layout(self) -> Counter:
        return Counter(gi.profile for gi in self.instances)

    def instances_without_ci(self) -> list[GpuInstance]:
        with_ci = {ci.gpu_instance_id for ci in self.compute_instances}
        return [gi for gi in self.instances if gi.instance_id not in with_ci]


@dataclass
class MigGpuPlan:
    row: GpuRow
    desired: list[str]
    summary: str
    commands: list[Command] = field(default_factory=list)
    error: str | None = None
    pending: bool = False


@dataclass
class MigGpuResult:
    row: GpuRow
    changed: bool
    summary: str
    error: str | None = None


def describe_layout(layout) -> str:
    counts = Counter(layout)
    return " + ".join(f"{n}× {name}" for name, n in sorted(counts.items())) or "no instances"


def desired_layouts(rows: list[GpuRow], layouts: dict[str, list[str]]) -> list[tuple[GpuRow, list[str]]]:
    """Pair each GPU with its layout: its uuid's entry, else its index's, else "all"'s."""
    for key in layouts:
        if key != "all" and not any(key in (row.uuid, str(row.index)) for row in rows):
            here = ", ".join(f"{row.index} {row.uuid}" for row in rows) or "none"
            raise MigError(f"node.mig: no GPU matches {key!r} (GPUs here: {here})")
    paired = []
    for row in rows:
        desired = layouts.get(row.uuid, layouts.get(str(row.index), layouts.get("all")))
        if desired is not None:
            paired.append((row, desired))
    return paired


def read_state(runner, row: GpuRow, with_profiles: bool = True) -> MigState:
    if row.mig_current != "Enabled":
        return MigState(row)
    profiles = _read_table(runner, mig_command(row.index, "-lgip"), parse_gi_profiles) if with_profiles else []
    instances = _read_table(runner, mig_command(row.index, "-lgi"), parse_gpu_instances)
    compute = _read_table(runner, mig_command(row.index, "-lci"), parse_compute_instances)
    return MigState(row, profiles, instances, compute)


def plan_gpu(state: MigState, desired: list[str]) -> MigGpuPlan:
    """What to run to go from `state` to `desired` (pure: no command is run)."""
    row = state.row
    gpu = f"GPU {row.index} ({row.name}, {row.pci_bus_id})"
    if not row.mig_supported:
        error = f"{gpu} does not support MIG" if desired else None
        return MigGpuPlan(row, desired, "no MIG on this GPU", error=error)
    if row.mig_current != row.mig_pending:
        return MigGpuPlan(row, desired, "MIG mode change pending", pending=True, error=(
            f"{gpu}: MIG mode change pending (current {row.mig_current}, pending {row.mig_pending}); it takes "
            "effect after a GPU reset or a reboot. gpushare never resets a GPU: reboot, or reset it yourself "
            "when nothing uses it, then apply again"))
    if not desired:
        if row.mig_current == "Disabled":
            return MigGpuPlan(row, desired, "MIG off, as configured")
        commands = _destroy_commands(state) + [Command((NVIDIA_SMI, "-i", str(row.index), "-mig", "0"))]
        return MigGpuPlan(row, desired, f"{describe_layout(state.layout())} -> MIG off", commands)
    if row.mig_current == "Disabled":
        # Profile ids are only listed once MIG is on; nvidia-smi also takes profile names.
        commands = [Command((NVIDIA_SMI, "-i", str(row.index), "-mig", "1")),
                    mig_command(row.index, "-cgi", ",".join(desired), "-C")]
        return MigGpuPlan(row, desired, f"enable MIG, then create {describe_layout(desired)}", commands)
    error = _validate(state, desired, gpu)
    if error:
        return MigGpuPlan(row, desired, "cannot be applied", error=error)
    if state.layout() == Counter(desired):
        missing = state.instances_without_ci()
        commands = [mig_command(row.index, "-gi", str(gi.instance_id), "-cci") for gi in missing]
        summary = describe_layout(desired) + (", as configured" if not missing else ", some without compute instance")
        return MigGpuPlan(row, desired, summary, commands)
    ids = {p.name: p.profile_id for p in state.profiles}
    create = mig_command(row.index, "-cgi", ",".join(str(ids[name]) for name in desired), "-C")
    summary = f"{describe_layout(state.layout())} -> {describe_layout(desired)}"
    return MigGpuPlan(row, desired, summary, _destroy_commands(state) + [create])


def plan_mig(runner, layouts: dict[str, list[str]]) -> list[MigGpuPlan]:
    paired = desired_layouts(read_gpu_rows(runner), layouts)
    return [plan_gpu(read_state(runner, row), desired) for row, desired in paired]


def apply_mig(runner, layouts: dict[str, list[str]]) -> list[MigGpuResult]:
    """One result per configured GPU; an error on one GPU does not stop the others."""
    results = []
    for row, desired in desired_layouts(read_gpu_rows(runner), layouts):
        try:
            results.append(_apply_gpu(runner, row, desired))
        except MigError as exc:
            results.append(MigGpuResult(row, False, "failed", str(exc)))
    return results


def creation_orders(desired: list[str], profiles: list[GiProfile]) -> list[tuple[str, ...]]:
    """The configured order first, then every distinct order, largest profiles first."""
    size = {p.name: (p.slices, p.memory_gib) for p in profiles}
    largest_first = sorted(desired, key=lambda name: size[name], reverse=True)
    orders = [tuple(desired)] + [o for o in dict.fromkeys(permutations(largest_first)) if o != tuple(desired)]
    return orders[:MAX_CREATION_ORDERS]


def _apply_gpu(runner, row: GpuRow, desired: list[str]) -> MigGpuResult:
    state = read_state(runner, row)
    plan = plan_gpu(state, desired)
    if plan.error:
        raise (MigPending if plan.pending else MigError)(plan.error)
    if not plan.commands:
        return MigGpuResult(row, False, plan.summary)
    summary = plan.summary
    if not desired:
        for command in plan.commands:
            _check(row, _run_mode_change(runner, row, command) if "-mig" in command.argv else runner.run(command))
        return MigGpuResult(row, True, summary)
    if row.mig_current == "Disabled":
        _check(row, _run_mode_change(runner, row, plan.commands[0]))
        row = replace(row, mig_current="Enabled", mig_pending="Enabled")
        state = read_state(runner, row)
        plan = plan_gpu(state, desired)
        if plan.error:
            raise MigError(plan.error)
    if state.layout() != Counter(desired):
        _destroy(runner, state)
        _create(runner, state, desired)
    else:
        for command in plan.commands:  # compute instances missing in GPU instances that are right
            _check(row, runner.run(command))
    after = read_state(runner, row, with_profiles=False)
    if after.layout() != Counter(desired) or after.instances_without_ci():
        raise MigError(f"GPU {row.index}: after the change nvidia-smi lists {describe_layout(after.layout())} "
                       f"({len(after.compute_instances)} compute instances), expected {describe_layout(desired)}")
    return MigGpuResult(row, True, summary)


def _run_mode_change(runner, row: GpuRow, command: Command) -> CommandResult:
    result = runner.run(command)
    pending = pending_mode_change(result.output)
    if pending:
        raise MigPending(f"GPU {row.index} ({row.pci_bus_id}): {pending}. The change takes effect after a GPU reset "
                         "or a reboot; gpushare never resets a GPU. Stop what uses the GPU and reset it, or reboot, "
                         "then apply again")
    return result


def _destroy_commands(state: MigState) -> list[Command]:
    commands = []
    if state.compute_instances:
        commands.append(mig_command(state.row.index, "-dci"))
    if state.instances:
        commands.append(mig_command(state.row.index, "-dgi"))
    return commands


def _destroy(runner, state: MigState) -> None:
    for command in _destroy_commands(state):
        _check(state.row, runner.run(command))


def _create(runner, state: MigState, desired: list[str]) -> None:
    ids = {p.name: p.profile_id for p in state.profiles}
    row, tried = state.row, []
    for order in creation_orders(desired, state.profiles):
        result = runner.run(mig_command(row.index, "-cgi", ",".join(str(ids[name]) for name in order), "-C"))
        reason = failure_reason(result.output)
        if reason is None and result.ok:
            return
        tried.append(",".join(order))
        if created_gpu_instances(result.output):  # a failed -cgi keeps what it created before failing
            if created_compute_instances(result.output):
                _check(row, runner.run(mig_command(row.index, "-dci")))
            _check(row, runner.run(mig_command(row.index, "-dgi")))
        if reason is None or "Insufficient Resources" not in reason:
            raise MigError(_failure_message(row, "creating GPU instances", result, reason))
    raise MigError(f"GPU {row.index}: no creation order fits {describe_layout(desired)} "
                   f"(Insufficient Resources for {len(tried)} order(s): {'; '.join(tried)})")


def _check(row: GpuRow, result: CommandResult) -> None:
    reason = failure_reason(result.output)
    if reason is not None or not result.ok:
        raise MigError(_failure_message(row, f"`{result.command.shell()}`", result, reason))


def _failure_message(row: GpuRow, what: str, result: CommandResult, reason: str | None) -> str:
    answer = reason or result.output.strip() or f"exit {result.returncode}"
    message = f"GPU {row.index} ({row.pci_bus_id}): {what} failed: {answer}"
    if reason and "In use by another client" in reason:
        message += (". A process holds the GPU (nvidia-smi lists them; an MPS daemon counts too: "
                    "gpushare node mps stop); stop it and apply again")
    return message


def _validate(state: MigState, desired: list[str], gpu: str) -> str | None:
    by_name = {p.name: p for p in state.profiles}
    unknown = sorted({name for name in desired if name not in by_name})
    if unknown:
        return f"{gpu} has no GPU instance profile {unknown[0]!r}; it offers: {', '.join(by_name)}"
    for name, count in Counter(desired).items():
        if count > by_name[name].total:
            return f"{gpu} allows at most {by_name[name].total}× {name}; node.mig asks for {count}"
    slices, most = sum(by_name[name].slices for name in desired), max(p.slices for p in state.profiles)
    if slices > most:
        return f"{gpu}: {describe_layout(desired)} needs {slices} compute slices; the GPU has {most}"
    return None


def _read_table(runner, command: Command, parse) -> list:
    result = runner.run(command)
    if nothing_listed(result.output):
        return []
    if not result.ok:
        raise MigError(f"`{command.shell()}` failed (exit {result.returncode}): {result.output.strip()}")
    return parse(result.stdout)
