"""MPS control daemons driven through a runner that replays recorded nvidia-smi and
nvidia-cuda-mps-control answers: exact command sequences, idempotence, failures."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "node"))
from node_fakes import ReplayRunner, recorded  # noqa: E402

from gpushare.node import mps  # noqa: E402
from gpushare.node.nvsmi import parse_list, parse_query  # noqa: E402
from gpushare.node.node_settings import MpsSettings  # noqa: E402

QUERY = ("nvidia-smi --query-gpu=index,uuid,name,pci.bus_id,mig.mode.current,mig.mode.pending,compute_mode "
         "--format=csv,noheader")
H100 = "GPU-b4895dbf-9350-2524-a89b-98161ddd9fe4"
DIRS = f"CUDA_MPS_PIPE_DIRECTORY=/run/gpushare/mps/{H100}/pipe CUDA_MPS_LOG_DIRECTORY=/run/gpushare/mps/{H100}/log"
GET = f"echo get_default_active_thread_percentage | {DIRS} nvidia-cuda-mps-control"
SET50 = f"echo 'set_default_active_thread_percentage 50' | {DIRS} nvidia-cuda-mps-control"
SETMEM = f"echo 'set_default_device_pinned_mem_limit 0 40G' | {DIRS} nvidia-cuda-mps-control"
QUIT = f"echo quit | {DIRS} nvidia-cuda-mps-control"
START = f"CUDA_VISIBLE_DEVICES={H100} {DIRS} nvidia-cuda-mps-control -d"
MKDIR = f"mkdir -p /run/gpushare/mps/{H100}/pipe /run/gpushare/mps/{H100}/log"
EXCLUSIVE = f"nvidia-smi -i {H100} -c EXCLUSIVE_PROCESS"
SILENT = recorded("mps-control_silent.txt")
EXCLUSIVE_ROW = "h100_query-gpu_mig-disabled_exclusive-process.csv.txt"
SETTINGS = MpsSettings(enabled=True, active_thread_percentage=50, pinned_device_mem_limit="40G")


def whole_gpu_runner(query_file, get_answers, **more):
    return ReplayRunner({
        QUERY: recorded(query_file), "nvidia-smi -L": recorded("h100_nvidia-smi-L_whole-gpu.txt"),
        GET: [recorded(name) for name in get_answers],
        EXCLUSIVE: recorded("nvidia-smi-c-exclusive-process_ok.txt"),
        "nvidia-smi -i " + H100 + " -c DEFAULT": recorded("nvidia-smi-c-default_ok.txt"),
        MKDIR: SILENT, START: SILENT, SET50: SILENT, SETMEM: SILENT, QUIT: SILENT, **more,
    })


def test_start_sets_exclusive_mode_first_then_defaults_before_clients_then_checks_health():
    runner = whole_gpu_runner("h100_query-gpu_mig-disabled.csv.txt",
                              ["mps-control_no-daemon.txt", "mps-control_get-percentage_50.txt"])
    targets, rows, notes = mps.read_targets(runner, SETTINGS.root)
    assert notes == []
    commands, notes = mps.start(runner, targets, rows, SETTINGS, sleep=lambda s: None)
    assert [c.shell() for c in commands] == [EXCLUSIVE, MKDIR, START, SET50, SETMEM] and notes == []
    assert runner.calls == [QUERY, "nvidia-smi -L", GET, EXCLUSIVE, MKDIR, START, SET50, SETMEM, GET]
    [daemon] = [c for c in runner.commands if c.argv == ("nvidia-cuda-mps-control", "-d")]
    assert dict(daemon.env) == {"CUDA_VISIBLE_DEVICES": H100,
                                "CUDA_MPS_PIPE_DIRECTORY": f"/run/gpushare/mps/{H100}/pipe",
                                "CUDA_MPS_LOG_DIRECTORY": f"/run/gpushare/mps/{H100}/log"}


def test_second_start_changes_nothing():
    runner = whole_gpu_runner(EXCLUSIVE_ROW, ["mps-control_get-percentage_50.txt"])
    targets, rows, _ = mps.read_targets(runner, SETTINGS.root)
    assert mps.plan_start(runner, targets, rows, SETTINGS) == ([], [])
    assert mps.start(runner, targets, rows, SETTINGS) == ([], [])
    assert runner.calls == [QUERY, "nvidia-smi -L", GET, GET]  # status reads only


def test_a_running_daemon_with_other_defaults_is_reported_not_restarted():
    runner = whole_gpu_runner(EXCLUSIVE_ROW, ["mps-control_get-percentage_100.txt"])
    targets, rows, _ = mps.read_targets(runner, SETTINGS.root)
    commands, notes = mps.plan_start(runner, targets, rows, SETTINGS)
    assert commands == []
    assert notes == [f"{H100}: MPS runs with default active thread percentage 100, the config says 50; the change "
                     "needs a restart (gpushare node mps stop, then start), which disconnects its clients"]


def test_stop_quits_then_restores_default_compute_mode():
    runner = whole_gpu_runner(EXCLUSIVE_ROW, ["mps-control_get-percentage_50.txt"])
    targets, rows, _ = mps.read_targets(runner, SETTINGS.root)
    assert [c.shell() for c in mps.stop(runner, targets, rows)] == [QUIT, f"nvidia-smi -i {H100} -c DEFAULT"]
    assert runner.calls == [QUERY, "nvidia-smi -L", GET, QUIT, f"nvidia-smi -i {H100} -c DEFAULT"]


def test_one_daemon_per_mig_instance_without_compute_mode_change():
    rows = parse_query(recorded("h100_query-gpu_mig-enabled.csv.txt").stdout)
    listed = parse_list(recorded("h100-80gb_nvidia-smi-L_mig-mixed.txt").stdout)
    targets, notes = mps.mps_targets(rows, listed, "/run/gpushare/mps")
    assert [t.uuid for t in targets] == [m.uuid for m in listed[0].mig_devices] and notes == []
    script = {}
    for target in targets:
        dirs = f"CUDA_MPS_PIPE_DIRECTORY={target.pipe_dir} CUDA_MPS_LOG_DIRECTORY={target.log_dir}"
        script[f"echo get_default_active_thread_percentage | {dirs} nvidia-cuda-mps-control"] = [
            recorded("mps-control_no-daemon.txt"), recorded("mps-control_get-percentage_100.txt")]
        script[f"mkdir -p {target.pipe_dir} {target.log_dir}"] = SILENT
        script[f"CUDA_VISIBLE_DEVICES={target.uuid} {dirs} nvidia-cuda-mps-control -d"] = SILENT
    runner = ReplayRunner(script)
    mps.start(runner, targets, rows, MpsSettings(enabled=True))
    assert [c for c in runner.calls if c.startswith("CUDA_VISIBLE_DEVICES=")] == [
        f"CUDA_VISIBLE_DEVICES={t.uuid} CUDA_MPS_PIPE_DIRECTORY=/run/gpushare/mps/{t.uuid}/pipe "
        f"CUDA_MPS_LOG_DIRECTORY=/run/gpushare/mps/{t.uuid}/log nvidia-cuda-mps-control -d" for t in targets]
    assert not any(" -c " in call for call in runner.calls)


def test_mig_on_without_instances_and_legacy_mig_ids():
    rows = parse_query(recorded("h100_query-gpu_mig-enabled.csv.txt").stdout)
    targets, notes = mps.mps_targets(rows, [], "/run/gpushare/mps")
    assert targets == [] and notes == [f"GPU 0 ({H100}): MIG is on but has no instances, so no MPS daemon"]
    [legacy] = parse_list(recorded("a100-40gb_nvidia-smi-L_mig-mixed_r450-uuid.txt").stdout)
    row = parse_query(f"0, {legacy.uuid}, A100-SXM4-40GB, 00000000:36:00.0, Enabled, Enabled, Default\n")
    first = mps.mps_targets(row, [legacy], "/run/gpushare/mps")[0][0]
    assert first.pipe_dir == "/run/gpushare/mps/MIG-GPU-4200ccc0-2667-d4cb-9137-f932c716232a_2_0/pipe"


def test_env_lines_for_clients():
    target = mps.MpsTarget(H100, H100, 0, "/run/gpushare/mps")
    assert mps.env_lines(target) == [f"export CUDA_MPS_PIPE_DIRECTORY=/run/gpushare/mps/{H100}/pipe",
                                     f"export CUDA_MPS_LOG_DIRECTORY=/run/gpushare/mps/{H100}/log"]


def test_compute_mode_refused_stops_before_the_daemon_starts():
    runner = whole_gpu_runner("h100_query-gpu_mig-disabled.csv.txt", ["mps-control_no-daemon.txt"],
                              **{EXCLUSIVE: recorded("nvidia-smi-c_insufficient-permissions.txt")})
    targets, rows, _ = mps.read_targets(runner, SETTINGS.root)
    with pytest.raises(mps.MpsError, match=f"`{EXCLUSIVE}` failed \\(exit 4\\): Unable to set the compute mode for "
                                           "GPU 00000000:42:00.0: Insufficient Permissions"):
        mps.start(runner, targets, rows, SETTINGS)
    assert runner.calls[-1] == EXCLUSIVE and START not in runner.calls


def test_a_daemon_that_never_answers_is_an_error():
    no_daemon = recorded("mps-control_no-daemon.txt")
    runner = whole_gpu_runner(EXCLUSIVE_ROW, ["mps-control_no-daemon.txt"],
                              **{SET50: no_daemon})
    targets, rows, _ = mps.read_targets(runner, SETTINGS.root)
    waits = []
    with pytest.raises(mps.MpsError, match="failed \\(exit 1\\): Cannot find MPS control daemon process"):
        mps.start(runner, targets, rows, SETTINGS, sleep=waits.append)
    assert runner.calls.count(SET50) == mps.START_ATTEMPTS and len(waits) == mps.START_ATTEMPTS
