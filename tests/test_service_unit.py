"""The shipped systemd files are valid for systemd itself: the unit passes
`systemd-analyze verify`, and the sysusers/tmpfiles entries create the user and the
directories when run against a staging root, as the install's follow-up commands do."""

import argparse
import configparser
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from gpushare.service import install

REPO = Path(__file__).resolve().parents[1]
FILES = REPO / "gpushare" / "service" / "files"

# Console output: elsewhere systemd tools may log their warnings to the journal or kmsg.
SYSTEMD_ENV = {**os.environ, "SYSTEMD_LOG_TARGET": "console"}


def needs(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} not found (Debian package: systemd)")
    return path


@pytest.mark.parametrize("repo_path, packaged", [
    ("systemd/gpushare.service", "gpushare.service"),
    ("systemd/gpushare.sysusers", "gpushare.sysusers"),
    ("systemd/gpushare.tmpfiles", "gpushare.tmpfiles"),
    ("configs/gpushare.yaml", "gpushare.yaml"),
])
def test_repository_copies_are_the_packaged_files(repo_path, packaged):
    # gpushare/service/files/ is the single source of truth (it ships in the wheel);
    # the repository paths are symlinks to it and must never drift.
    assert (REPO / repo_path).read_bytes() == install.packaged_file(packaged).encode()


def test_unit_declares_the_service_contract():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read_string(install.packaged_file("gpushare.service"))
    service = unit["Service"]
    assert service["Type"] == "notify"
    assert service["NotifyAccess"] == "main"
    assert service["WatchdogSec"] == "30s"
    assert service["KillMode"] == "mixed"
    assert service["RuntimeDirectoryPreserve"] == "yes", "MPS pipe folders must outlive a restart"
    assert service["User"] == "gpushare"
    assert service["DevicePolicy"] == "closed"
    assert service["ProtectSystem"] == "strict"
    assert "PrivateDevices" not in service, "would hide /dev/nvidia*"
    assert "MemoryDenyWriteExecute" not in service, "Triton and CUDA JIT need W+X memory"


def test_example_config_is_accepted_by_the_daemon(monkeypatch):
    from gpushare.settings.settings import load_settings

    for name in ("GPUSHARE_HOST", "GPUSHARE_MODELS", "GPUSHARE_KEEP_ALIVE"):
        monkeypatch.delenv(name, raising=False)
    settings = load_settings(FILES / "gpushare.yaml")
    assert settings.server.host == "127.0.0.1:11434"
    assert settings.server.drain_timeout_s == 30.0
    assert str(settings.models_dir) == "/var/lib/gpushare/models"
    assert (settings.engine.dtype, settings.engine.max_num_seqs,
            settings.engine.max_num_batched_tokens, settings.engine.block_size) == (
        "float32", 64, 2048, 16)
    assert (settings.memory.budget_bytes, settings.memory.kv_budget_bytes) == (8 << 30, 2 << 30)


def test_unit_passes_systemd_analyze_verify(tmp_path):
    analyze = needs("systemd-analyze")
    # verify fails on an ExecStart= binary that does not exist, and the packaged
    # /usr/bin/gpushare is not installed here: point it at /bin/true, as `service install`
    # points it at the real executable. (ExecStartPre=-+... is optional, so not checked.)
    unit = tmp_path / "gpushare.service"
    unit.write_text(install.render_unit(install.packaged_file("gpushare.service"), "/bin/true"))
    result = subprocess.run([analyze, "verify", "--man=no", str(unit)],
                            capture_output=True, text=True, env=SYSTEMD_ENV, timeout=120)
    # Unknown keys and bad values are only warnings (exit 0): any line naming our unit fails.
    complaints = [line for line in (result.stdout + result.stderr).splitlines()
                  if "gpushare.service" in line]
    assert result.returncode == 0 and complaints == [], result.stdout + result.stderr


def test_verify_catches_a_broken_unit(tmp_path):
    # Guards the test above: a typo must show up as a complaint.
    analyze = needs("systemd-analyze")
    unit = tmp_path / "gpushare.service"
    text = install.render_unit(install.packaged_file("gpushare.service"), "/bin/true")
    unit.write_text(text.replace("KillMode=mixed", "KillMode=mixd"))
    result = subprocess.run([analyze, "verify", "--man=no", str(unit)],
                            capture_output=True, text=True, env=SYSTEMD_ENV, timeout=120)
    assert "mixd" in result.stderr


def test_sysusers_and_tmpfiles_create_user_and_directories(tmp_path):
    sysusers, tmpfiles = needs("systemd-sysusers"), needs("systemd-tmpfiles")
    if os.geteuid() != 0:
        pytest.skip("systemd-tmpfiles chowns to the new user: needs root")
    root = tmp_path / "root"
    parser = argparse.ArgumentParser()
    install.add_service_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["service", "install", "--prefix", str(root), "--exec-path", "/bin/true"])
    assert args.func(args) == 0

    # The install's follow-up commands, against the staging root instead of /.
    subprocess.run([sysusers, f"--root={root}", str(root / "etc/sysusers.d/gpushare.conf")],
                   check=True, capture_output=True, env=SYSTEMD_ENV, timeout=60)
    passwd = {line.split(":")[0]: line.split(":") for line in
              (root / "etc/passwd").read_text().splitlines()}
    assert passwd["gpushare"][5] == "/var/lib/gpushare"
    uid, gid = int(passwd["gpushare"][2]), int(passwd["gpushare"][3])
    video = [line for line in (root / "etc/group").read_text().splitlines()
             if line.startswith("video:")]
    assert video and "gpushare" in video[0].split(":")[3].split(",")

    subprocess.run([tmpfiles, f"--root={root}", "--create",
                    str(root / "etc/tmpfiles.d/gpushare.conf")],
                   check=True, capture_output=True, env=SYSTEMD_ENV, timeout=60)
    models = root / "var/lib/gpushare/models"
    assert models.is_dir()
    assert (models.stat().st_uid, models.stat().st_gid) == (uid, gid)
    config = (root / "etc/gpushare/gpushare.yaml").stat()
    assert (config.st_uid, config.st_gid, config.st_mode & 0o777) == (0, gid, 0o640)
