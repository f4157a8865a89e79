"""`gpushare service install` into a staging root, as an administrator would run it."""

import argparse
import stat
import sys
from pathlib import Path

import pytest

from gpushare.service import install

REPO = Path(__file__).resolve().parents[1]
FILES = REPO / "gpushare" / "service" / "files"


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="gpushare")
    install.add_service_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["service", "install", *argv])
    return args.func(args)


def test_install_writes_unit_sysusers_tmpfiles_and_config(tmp_path, capsys):
    assert run_cli("--prefix", str(tmp_path), "--exec-path", "/opt/gpushare/bin/gpushare") == 0
    unit = (tmp_path / "etc/systemd/system/gpushare.service").read_text()
    exec_start = "ExecStart=/opt/gpushare/bin/gpushare serve --config /etc/gpushare/gpushare.yaml"
    assert exec_start + "\n" in unit
    assert "/usr/bin/gpushare" not in unit
    assert unit.replace("/opt/gpushare/bin/gpushare", "/usr/bin/gpushare") == (
        FILES / "gpushare.service").read_text()
    assert (tmp_path / "etc/sysusers.d/gpushare.conf").read_text() == (
        FILES / "gpushare.sysusers").read_text()
    assert (tmp_path / "etc/tmpfiles.d/gpushare.conf").read_text() == (
        FILES / "gpushare.tmpfiles").read_text()
    config = tmp_path / "etc/gpushare/gpushare.yaml"
    assert config.read_text() == (FILES / "gpushare.yaml").read_text()
    assert stat.S_IMODE(config.stat().st_mode) == 0o640
    assert stat.S_IMODE((tmp_path / "etc/systemd/system/gpushare.service").stat().st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == [
        "gpushare.conf", "gpushare.conf", "gpushare.service", "gpushare.yaml"]

    out = capsys.readouterr().out
    commands = [line.strip() for line in out.splitlines() if line.startswith("    ")]
    assert commands == [
        "systemd-sysusers /etc/sysusers.d/gpushare.conf",
        "systemd-tmpfiles --create /etc/tmpfiles.d/gpushare.conf",
        "systemctl daemon-reload",
        "systemctl enable --now gpushare.service",
    ]


def test_install_never_overwrites_an_existing_config(tmp_path, capsys):
    config = tmp_path / "etc/gpushare/gpushare.yaml"
    config.parent.mkdir(parents=True)
    config.write_text("server: {host: 0.0.0.0:8080}\n")
    old_unit = tmp_path / "etc/systemd/system/gpushare.service"
    old_unit.parent.mkdir(parents=True)
    old_unit.write_text("[Service]\nExecStart=/old/gpushare\n")

    assert run_cli("--prefix", str(tmp_path), "--exec-path", "/opt/gpushare/bin/gpushare") == 0
    assert config.read_text() == "server: {host: 0.0.0.0:8080}\n"
    assert "ExecStart=/opt/gpushare/bin/gpushare serve" in old_unit.read_text()
    assert f"kept {config}" in capsys.readouterr().out


def test_dry_run_prints_every_file_and_writes_nothing(tmp_path, capsys):
    assert run_cli("--dry-run", "--prefix", str(tmp_path),
                   "--exec-path", "/opt/gs/bin/gpushare") == 0
    assert list(tmp_path.iterdir()) == []
    out = capsys.readouterr().out
    for target in ("etc/systemd/system/gpushare.service", "etc/sysusers.d/gpushare.conf",
                   "etc/tmpfiles.d/gpushare.conf", "etc/gpushare/gpushare.yaml"):
        assert f"would write {tmp_path / target}" in out
    assert "    ExecStart=/opt/gs/bin/gpushare serve --config /etc/gpushare/gpushare.yaml" in out
    assert "    u gpushare - " in out
    assert "systemctl enable --now gpushare.service" in out


def test_default_exec_start_is_this_environments_gpushare(tmp_path):
    script = Path(sys.executable).parent / "gpushare"
    if not script.exists():
        pytest.skip(f"{script} not installed (pip install -e .)")
    assert run_cli("--prefix", str(tmp_path)) == 0
    unit = (tmp_path / "etc/systemd/system/gpushare.service").read_text()
    assert f"ExecStart={script} serve --config /etc/gpushare/gpushare.yaml\n" in unit


def test_warns_when_protect_home_would_hide_the_executable(tmp_path, capsys):
    assert run_cli("--prefix", str(tmp_path), "--exec-path", "/home/alice/venv/bin/gpushare") == 0
    err = capsys.readouterr().err
    assert "cannot see /home/alice/venv/bin/gpushare (ProtectHome=yes)" in err


def test_warns_when_the_scripts_interpreter_lives_in_a_home(tmp_path, capsys):
    script = tmp_path / "gpushare"
    script.write_text("#!/root/.pyenv/versions/3.11.7/bin/python3\nprint()\n")
    assert run_cli("--dry-run", "--prefix", str(tmp_path), "--exec-path", str(script)) == 0
    assert "cannot see /root/.pyenv/versions/3.11.7/bin/python3" in capsys.readouterr().err


def test_unwritable_target_fails_with_exit_1_and_names_the_file(tmp_path, capsys):
    (tmp_path / "etc").write_text("a file where a directory belongs\n")
    assert run_cli("--prefix", str(tmp_path), "--exec-path", "/opt/gs/bin/gpushare") == 1
    err = capsys.readouterr().err
    assert f"cannot write {tmp_path / 'etc/systemd/system/gpushare.service'}" in err
