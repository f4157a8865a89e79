"""MPS control daemons: one per GPU, or one per MIG instance when MIG is on.

Each daemon gets its own pipe and log directories under `/run/gpushare/mps/<uuid>/`, never
the default /tmp/nvidia-mps, which systemd's PrivateTmp hides from other services. Start:
compute mode EXCLUSIVE_PROCESS first (whole GPUs only: the MIG guide runs one daemon per
MIG instance without it), then `nvidia-cuda-mps-control -d` with CUDA_VISIBLE_DEVICES set
to the one GPU or MIG instance, then the defaults (`set_default_active_thread_percentage`,
`set_default_device_pinned_mem_limit`) before any client connects; health is the answer
to `get_default_active_thread_percentage`. Stop: `quit`, then compute mode back to DEFAULT.
Settings of a running daemon are only reported, never changed by a restart: quitting
would cut off its clients.

What the control client answers is not documented; this relies only on: exit status 0 for
`-d`, `set_default_*` and `quit`; `Cannot find MPS control daemon process` (exit 1) when no
daemon listens on the pipe directory; a number (`100.0`) for the percentage query.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from gpushare.node.nvsmi import NVIDIA_SMI, GpuRow, ListedGpu, read_gpu_rows, read_listed_gpus
from gpushare.node.runner import Command, CommandResult, NodeError
from gpushare.node.node_settings import MpsSettings

CONTROL = "nvidia-cuda-mps-control"
NO_DAEMON = "Cannot find MPS control daemon process"
START_ATTEMPTS = 50  # `-d` returns before the control socket accepts commands
START_RETRY_S = 0.1


class MpsError(NodeError):
    pass


@dataclass(frozen=True)
class MpsTarget:
    """What one control daemon drives: a whole GPU or one MIG instance."""

    uuid: str  # GPU-... or MIG-...
    gpu_uuid: str
    gpu_index: int
    root: str

    @property
    def is_mig(self) -> bool:
        return self.uuid != self.gpu_uuid

    @property
    def directory(self) -> str:
        # Legacy R450 MIG ids (MIG-GPU-<uuid>/<gi>/<ci>) contain slashes.
        return f"{self.root}/{self.uuid.replace('/', '_')}"

    @property
    def pipe_dir(self) -> str:
        return f"{self.directory}/pipe"

    @property
    def log_dir(self) -> str:
        return f"{self.directory}/log"

    def client_env(self) -> tuple[tuple[str, str], ...]:
        """What a client sets to use this daemon. A client may also set CUDA_VISIBLE_DEVICES to this
        target's UUID (the MIG guide's MPS example does; MPS's docs call UUIDs unambiguous), but
        never to an index: the server renumbers the devices it sees from 0."""
        return (("CUDA_MPS_PIPE_DIRECTORY", self.pipe_dir), ("CUDA_MPS_LOG_DIRECTORY", self.log_dir))

    def daemon_env(self) -> tuple[tuple[str, str], ...]:
        return (("CUDA_VISIBLE_DEVICES", self.uuid),) + self.client_env()


@dataclass
class MpsStatus:
    target: MpsTarget
    running: bool
    active_thread_percentage: float | None
    detail: str


def mps_targets(rows: list[GpuRow], listed: list[ListedGpu], root: str) -> tuple[list[MpsTarget], list[str]]:
    by_uuid = {gpu.uuid: gpu for gpu in listed}
    targets, notes = [], []
    for row in rows:
        if row.mig_current == "Enabled":
            migs = by_uuid[row.uuid].mig_devices if row.uuid in by_uuid else []
            if not migs:
                notes.append(f"GPU {row.index} ({row.uuid}): MIG is on but has no instances, so no MPS daemon")
            targets += [MpsTarget(mig.uuid, row.uuid, row.index, root) for mig in migs]
        else:
            targets.append(MpsTarget(row.uuid, row.uuid, row.index, root))
    return targets, notes


def read_targets(runner, root: str) -> tuple[list[MpsTarget], list[GpuRow], list[str]]:
    """Targets from `nvidia-smi --query-gpu` (MIG mode, compute mode) and `nvidia-smi -L` (MIG uuids)."""
    rows = read_gpu_rows(runner)
    targets, notes = mps_targets(rows, read_listed_gpus(runner) if rows else [], root)
    return targets, rows, notes


def control_command(target: MpsTarget, line: str) -> Command:
    return Command((CONTROL,), target.client_env(), line)


def status(runner, target: MpsTarget) -> MpsStatus:
    result = runner.run(control_command(target, "get_default_active_thread_percentage"))
    value = _percentage(result.stdout) if result.ok else None
    if value is not None:
        return MpsStatus(target, True, value, f"running, default active thread percentage {value:g}")
    if NO_DAEMON in result.output:
        return MpsStatus(target, False, None, "not running")
    if result.returncode == 127:
        return MpsStatus(target, False, None, f"{CONTROL} is not installed")
    answer = result.output.strip() or f"exit {result.returncode}"
    return MpsStatus(target, False, None, f"no answer from the control daemon: {answer}")


def plan_start(runner, targets: list[MpsTarget], rows: list[GpuRow],
               settings: MpsSettings) -> tuple[list[Command], list[str]]:
    """Commands `start` would run (daemon status is read, nothing is changed)."""
    notes, starts = [], []
    for target in targets:
        current = status(runner, target)
        if not current.running:
            starts += _start_commands(target, settings)
            continue
        wanted = settings.active_thread_percentage
        if wanted is not None and current.active_thread_percentage != float(wanted):
            notes.append(f"{target.uuid}: MPS runs with default active thread percentage "
                         f"{current.active_thread_percentage:g}, the config says {wanted}; the change needs a restart "
                         "(gpushare node mps stop, then start), which disconnects its clients")
    whole = {t.gpu_uuid for t in targets if not t.is_mig}
    modes = [_compute_mode(row.uuid, "EXCLUSIVE_PROCESS") for row in rows
             if row.uuid in whole and row.compute_mode != "Exclusive_Process"]
    return modes + starts, notes


def start(runner, targets: list[MpsTarget], rows: list[GpuRow], settings: MpsSettings,
          sleep=time.sleep) -> tuple[list[Command], list[str]]:
    """Start what is not running; returns (commands run, notes). MpsError carries the tool's words."""
    commands, notes = plan_start(runner, targets, rows, settings)
    for command in commands:
        if command.input_text is not None:
            result = _until_daemon_answers(runner, command, sleep)
        else:
            result = runner.run(command)
        _check(result)
    started = {dict(c.env)["CUDA_VISIBLE_DEVICES"] for c in commands if c.argv == (CONTROL, "-d")}
    for target in targets:
        if target.uuid in started:
            query = control_command(target, "get_default_active_thread_percentage")
            health = _until_daemon_answers(runner, query, sleep)
            value = _percentage(health.stdout) if health.ok else None
            wanted = settings.active_thread_percentage
            if value is None or (wanted is not None and value != float(wanted)):
                raise MpsError(f"MPS daemon for {target.uuid} is not healthy after start: "
                               f"get_default_active_thread_percentage answered {health.output.strip()!r}")
    return commands, notes


def plan_stop(runner, targets: list[MpsTarget], rows: list[GpuRow]) -> list[Command]:
    quits = [control_command(t, "quit") for t in targets if status(runner, t).running]
    whole = {t.gpu_uuid for t in targets if not t.is_mig}
    modes = [_compute_mode(row.uuid, "DEFAULT") for row in rows if row.uuid in whole and row.compute_mode != "Default"]
    return quits + modes


def stop(runner, targets: list[MpsTarget], rows: list[GpuRow]) -> list[Command]:
    """Quit running daemons, then compute mode back to DEFAULT; returns the commands run."""
    commands = plan_stop(runner, targets, rows)
    for command in commands:
        _check(runner.run(command))
    return commands


def env_lines(target: MpsTarget) -> list[str]:
    return [f"export {key}={value}" for key, value in target.client_env()]


def _start_commands(target: MpsTarget, settings: MpsSettings) -> list[Command]:
    commands = [Command(("mkdir", "-p", target.pipe_dir, target.log_dir)),
                Command((CONTROL, "-d"), target.daemon_env())]
    percentage, limit = settings.active_thread_percentage, settings.pinned_device_mem_limit
    if percentage is not None:
        commands.append(control_command(target, f"set_default_active_thread_percentage {percentage}"))
    if limit is not None:
        # Device 0 is the daemon's only visible device (CUDA_VISIBLE_DEVICES is one uuid).
        commands.append(control_command(target, f"set_default_device_pinned_mem_limit 0 {limit}"))
    return commands


def _compute_mode(uuid: str, mode: str) -> Command:
    return Command((NVIDIA_SMI, "-i", uuid, "-c", mode))


def _until_daemon_answers(runner, command: Command, sleep) -> CommandResult:
    for _ in range(START_ATTEMPTS):
        result = runner.run(command)
        if NO_DAEMON not in result.output:
            return result
        sleep(START_RETRY_S)
    return result


def _check(result: CommandResult) -> None:
    if not result.ok:
        raise MpsError(f"`{result.command.shell()}` failed (exit {result.returncode}): "
                       f"{result.output.strip() or 'no output'}")


def _percentage(text: str) -> float | None:
    try:
        return float(text.strip())
    except ValueError:
        return None
