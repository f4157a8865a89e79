"""Helper processes kept between requests (chat templates, a flood's tokenising): one is taken for each
job, given back when it answered, killed when it did not; a dead one is replaced on the next take."""

from __future__ import annotations

import subprocess
import threading
from dataclasses import dataclass, field


@dataclass
class ChildPool:
    command: list[str]
    idle: list[subprocess.Popen] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, fresh: bool = False) -> subprocess.Popen:
        """An idle child that is still alive, or a new one (pipes on stdin and stdout, unbuffered);
        ``fresh``: a new one."""
        with self.lock:
            while self.idle and not fresh:
                proc = self.idle.pop()
                if proc.poll() is None:
                    return proc
        return subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, bufsize=0)

    def give_back(self, proc: subprocess.Popen) -> None:
        with self.lock:
            self.idle.append(proc)


def kill(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()
    proc.stdin.close()
    proc.stdout.close()
