"""The one place gpushare runs an external program (nvidia-smi, nvidia-cuda-mps-control, mkdir).

Node code builds `Command` values and hands them to a runner, so `gpushare node plan`
can print the exact commands `apply` would run, and tests can replay recorded tool
outputs through a fake runner while exercising the real planning and parsing code.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import tempfile
from dataclasses import dataclass

DEFAULT_TIMEOUT_S = 120.0


class NodeError(RuntimeError):
    """A node tool (nvidia-smi, nvidia-cuda-mps-control) refused or failed; the message says
    what was run and what it answered."""


@dataclass(frozen=True)
class Command:
    """One external command: argv, extra environment variables and text for stdin."""

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    input_text: str | None = None

    def shell(self) -> str:
        """The command as a shell line a person could paste (what `node plan` prints)."""
        line = shlex.join(self.argv)
        if self.env:
            line = " ".join(f"{key}={shlex.quote(value)}" for key, value in self.env) + " " + line
        if self.input_text is not None:
            line = f"echo {shlex.quote(self.input_text)} | {line}"
        return line


@dataclass
class CommandResult:
    command: Command
    returncode: int
    stdout: str
    stderr: str = ""

    @property
    def output(self) -> str:
        """stdout and stderr together: nvidia-smi prints some errors on stdout, some on stderr."""
        if self.stdout and self.stderr:
            return self.stdout.rstrip("\n") + "\n" + self.stderr
        return self.stdout or self.stderr

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class SubprocessRunner:
    """Runs commands for real. A missing program is a result (exit 127), not an exception,
    so callers can report "no NVIDIA driver" the same way as any other failure."""

    def run(self, command: Command, timeout_s: float = DEFAULT_TIMEOUT_S) -> CommandResult:
        env = dict(os.environ)
        env.update(dict(command.env))
        stdin = None if command.input_text is None else command.input_text + "\n"
        # Output goes to files, not pipes: `nvidia-cuda-mps-control -d` leaves a daemon behind,
        # and a daemon that kept a pipe open would make us wait for it until the timeout.
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            try:
                done = subprocess.run(list(command.argv), input=stdin.encode() if stdin else None, env=env,
                                      stdout=out, stderr=err, timeout=timeout_s, check=False)
            except FileNotFoundError:
                return CommandResult(command, 127, "", f"{command.argv[0]}: command not found")
            except subprocess.TimeoutExpired:
                return CommandResult(command, 124, "", f"{command.argv[0]}: timed out after {timeout_s:g} s")
            out.seek(0)
            err.seek(0)
            return CommandResult(command, done.returncode, out.read().decode(errors="replace"),
                                 err.read().decode(errors="replace"))
