"""The one runner of external commands, run for real with ordinary shell tools."""

import os
import signal
import time

from gpushare.node.runner import Command, SubprocessRunner


def test_exit_status_output_environment_and_stdin():
    runner = SubprocessRunner()
    result = runner.run(Command(("sh", "-c", "echo out; echo err >&2; exit 3")))
    assert (result.returncode, result.stdout, result.stderr) == (3, "out\n", "err\n")
    assert (result.output, result.ok) == ("out\nerr\n", False)
    assert runner.run(Command(("sh", "-c", "echo $GPUSHARE_T"), (("GPUSHARE_T", "a b"),))).stdout == "a b\n"
    assert runner.run(Command(("cat",), (), "get_server_list")).stdout == "get_server_list\n"


def test_missing_program_and_timeout_are_results():
    runner = SubprocessRunner()
    missing = runner.run(Command(("gpushare-no-such-tool",)))
    assert (missing.returncode, missing.output) == (127, "gpushare-no-such-tool: command not found")
    slow = runner.run(Command(("sleep", "5")), timeout_s=0.2)
    assert (slow.returncode, slow.output) == (124, "sleep: timed out after 0.2 s")


def test_a_daemon_left_behind_does_not_hold_the_runner():
    # Like `nvidia-cuda-mps-control -d`: the command exits, a child keeps its stdout open.
    started = time.monotonic()
    result = SubprocessRunner().run(Command(("sh", "-c", "(sleep 20) & echo $!")), timeout_s=15)
    try:
        assert result.ok and time.monotonic() - started < 10
    finally:
        os.kill(int(result.stdout), signal.SIGTERM)


def test_shell_line_for_plans():
    command = Command(("nvidia-cuda-mps-control",), (("CUDA_MPS_PIPE_DIRECTORY", "/run/gpushare/mps/GPU-1/pipe"),),
                      "set_default_active_thread_percentage 50")
    assert command.shell() == ("echo 'set_default_active_thread_percentage 50' | "
                               "CUDA_MPS_PIPE_DIRECTORY=/run/gpushare/mps/GPU-1/pipe nvidia-cuda-mps-control")
