"""`gpushare service install`: put the systemd unit, the sysusers.d and tmpfiles.d entries
and an example config in place, then print the commands that finish the job.

The files ship inside the package, in gpushare/service/files/: that folder is the single
source of truth, and the repository's systemd/ and configs/gpushare.yaml are symlinks to it.
--prefix is a staging root (like DESTDIR): files land under it, but their contents always
name the final paths. sysusers.d goes to /etc/sysusers.d rather than /usr/lib/sysusers.d:
/usr/lib belongs to the distribution's package manager, /etc to the administrator, and an
install by hand is the administrator's. The config is written once and never overwritten;
the other files are ours and are replaced (local changes go in `systemctl edit` drop-ins).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path


@dataclass(frozen=True)
class InstallFile:
    source: str  # file name in gpushare/service/files/
    target: str  # absolute path on the installed system
    mode: int
    overwrite: bool


INSTALL_FILES = (
    InstallFile("gpushare.service", "/etc/systemd/system/gpushare.service", 0o644, True),
    InstallFile("gpushare.sysusers", "/etc/sysusers.d/gpushare.conf", 0o644, True),
    InstallFile("gpushare.tmpfiles", "/etc/tmpfiles.d/gpushare.conf", 0o644, True),
    # 0640: tenants' API keys may go in here; tmpfiles.d hands it to group gpushare.
    InstallFile("gpushare.yaml", "/etc/gpushare/gpushare.yaml", 0o640, False),
)

FOLLOW_UP_COMMANDS = (
    "systemd-sysusers /etc/sysusers.d/gpushare.conf",
    "systemd-tmpfiles --create /etc/tmpfiles.d/gpushare.conf",
    "systemctl daemon-reload",
    "systemctl enable --now gpushare.service",
)

PACKAGED_EXEC_START = "ExecStart=/usr/bin/gpushare "
# ProtectHome=yes in the unit makes these invisible to the service.
HIDDEN_BY_PROTECT_HOME = ("/home", "/root", "/run/user")


def packaged_file(name: str) -> str:
    return resources.files("gpushare.service").joinpath("files", name).read_text()


def find_gpushare_executable() -> str:
    """The gpushare script of the environment running this command, else the one on PATH."""
    beside_python = Path(sys.executable).parent / "gpushare"
    if beside_python.is_file() and os.access(beside_python, os.X_OK):
        return str(beside_python)
    return shutil.which("gpushare") or "/usr/bin/gpushare"


def render_unit(unit_text: str, exec_path: str) -> str:
    """The packaged unit with ExecStart= pointing at `exec_path`."""
    if PACKAGED_EXEC_START not in unit_text:
        raise ValueError(f"packaged unit has no line starting {PACKAGED_EXEC_START!r}")
    quoted = f'"{exec_path}"' if re.search(r"\s", exec_path) else exec_path
    return unit_text.replace(PACKAGED_EXEC_START, f"ExecStart={quoted} ", 1)


def paths_hidden_from_service(exec_path: str) -> list[str]:
    """Paths ExecStart= needs (the script, where it links to, its interpreter) that
    ProtectHome=yes hides: a venv under /root or a pyenv Python breaks the service."""
    needed = [exec_path, os.path.realpath(exec_path)]
    try:
        with open(exec_path, "rb") as script:
            first_line = script.readline().decode(errors="replace")
        if first_line.startswith("#!"):
            interpreter = first_line[2:].split()[0]
            needed += [interpreter, os.path.realpath(interpreter)]
    except (OSError, IndexError):
        pass
    hidden = [path for path in needed
              if any(path == d or path.startswith(d + "/") for d in HIDDEN_BY_PROTECT_HOME)]
    return list(dict.fromkeys(hidden))


def write_atomically(dest: Path, text: str, mode: int) -> None:
    # A half-written unit or config must never be what systemd or the daemon reads.
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, dest)
    except BaseException:
        os.unlink(tmp)
        raise


def run_install(args: argparse.Namespace) -> int:
    root = Path(args.prefix)
    # systemd takes only absolute ExecStart= paths.
    exec_path = os.path.abspath(args.exec_path or find_gpushare_executable())
    for hidden in paths_hidden_from_service(exec_path):
        print(f"warning: the service cannot see {hidden} (ProtectHome=yes): install gpushare "
              "outside home directories (e.g. a venv in /opt/gpushare), or add "
              "ProtectHome=read-only with `systemctl edit gpushare`", file=sys.stderr)
    for item in INSTALL_FILES:
        dest = root / item.target.lstrip("/")
        text = packaged_file(item.source)
        if item.source == "gpushare.service":
            text = render_unit(text, exec_path)
        if dest.exists() and not item.overwrite:
            print(f"kept {dest} (exists; never overwritten)")
        elif args.dry_run:
            print(f"would write {dest} (mode {item.mode:04o}):")
            print("".join(f"    {line}" for line in text.splitlines(keepends=True)))
        else:
            try:
                write_atomically(dest, text, item.mode)
            except OSError as exc:
                denied = isinstance(exc, PermissionError)
                hint = " (run as root, or try --dry-run)" if denied else ""
                print(f"gpushare service install: cannot write {dest}: {exc}{hint}",
                      file=sys.stderr)
                return 1
            print(f"wrote {dest}")
    staged = "" if root == Path("/") else f" (on the system that {root} is staged for)"
    print(f"\nnext, as root{staged}:")
    for command in FOLLOW_UP_COMMANDS:
        print(f"    {command}")
    return 0


def add_service_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `service install` to the CLI; the parsed namespace's `func(args)` runs it."""
    service = subparsers.add_parser("service", help="run gpushare as a systemd service")
    actions = service.add_subparsers(dest="service_command", required=True, metavar="COMMAND")
    install = actions.add_parser(
        "install", help="install the systemd unit, sysusers/tmpfiles entries and config",
        description="Write /etc/systemd/system/gpushare.service, /etc/sysusers.d/gpushare.conf, "
        "/etc/tmpfiles.d/gpushare.conf and (only if absent) /etc/gpushare/gpushare.yaml, then "
        "print the systemd commands that create the user and start the service.")
    install.add_argument("--dry-run", action="store_true",
                         help="print each file and its contents instead of writing")
    install.add_argument("--prefix", default="/", metavar="DIR",
                         help="staging root to install under (default /); file contents "
                         "still name the final paths")
    install.add_argument("--exec-path", metavar="PATH",
                         help="gpushare executable for ExecStart= (default: the one beside "
                         "this Python, else the one on PATH)")
    install.set_defaults(func=run_install)
    return service
