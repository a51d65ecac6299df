"""The LaunchAgent plist: every key the issue asks for, parsed back with plistlib."""

from __future__ import annotations

import os
import plistlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mtplxctl.launchd.plist import build_plist, plist_problems, render_plist
from mtplxctl.launchd.spec import STOP_MARGIN_SECONDS, build_spec
from mtplxd.config import ConfigError


def _rendered() -> dict:
    return plistlib.loads(render_plist(build_spec()))


def test_plist_round_trips_with_every_required_key(isolated_home: Path, tmp_path: Path):
    plist = _rendered()
    assert plist["Label"] == "com.mtplx.mtplxd"
    assert plist["ProgramArguments"] == [os.path.abspath(sys.executable), "-m", "mtplxd"]
    assert plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"SuccessfulExit": False}
    assert plist["ThrottleInterval"] == 10
    assert plist["ProcessType"] == "Interactive"
    # Default shutdown_grace_seconds is 10: the daemon drains for 10 s, launchd waits 10 + margin.
    assert plist["ExitTimeOut"] == 10 + STOP_MARGIN_SECONDS >= 10 + 15
    env = plist["EnvironmentVariables"]
    assert env["MTPLX_HOME"] == str(isolated_home)
    assert env["MTPLX_SUPERVISOR"] == "launchd"
    assert env["PATH"].split(":")[0] == os.path.dirname(os.path.abspath(sys.executable))
    assert plist["StandardOutPath"] == plist["StandardErrorPath"] == str(isolated_home / "logs" / "mtplxd.out")
    assert plist_problems(plist) == []
    if shutil.which("plutil"):
        path = tmp_path / "com.mtplx.mtplxd.plist"
        path.write_bytes(render_plist(build_spec()))
        subprocess.run(["plutil", "-lint", str(path)], check=True)


def test_the_interpreter_path_keeps_the_venv_symlink():
    # A venv's python is a symlink: resolving it would run the base interpreter without the venv.
    assert _rendered()["ProgramArguments"][0] == os.path.abspath(sys.executable)


def test_default_home_is_not_written(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("MTPLX_HOME", str(Path.home() / ".mtplx"))
    assert "MTPLX_HOME" not in _rendered()["EnvironmentVariables"]
    monkeypatch.delenv("MTPLX_HOME")
    plist = _rendered()
    assert "MTPLX_HOME" not in plist["EnvironmentVariables"]
    assert plist["StandardOutPath"] == str(Path.home() / ".mtplx" / "logs" / "mtplxd.out")


def test_relative_home_and_socket_are_made_absolute(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MTPLX_HOME", "state")
    monkeypatch.setenv("MTPLX_SOCKET", "~/ctl.sock")
    env = _rendered()["EnvironmentVariables"]
    assert env["MTPLX_HOME"] == str(tmp_path / "state")
    assert env["MTPLX_SOCKET"] == str(Path.home() / "ctl.sock")


def test_exit_timeout_follows_the_configured_grace(isolated_home: Path):
    isolated_home.mkdir(parents=True, exist_ok=True)
    (isolated_home / "config.toml").write_text("shutdown_grace_seconds = 45\n")
    assert _rendered()["ExitTimeOut"] == 45 + STOP_MARGIN_SECONDS


def test_broken_config_stops_install_but_not_start(isolated_home: Path):
    isolated_home.mkdir(parents=True, exist_ok=True)
    (isolated_home / "config.toml").write_text("shutdown_grace_seconds = 'soon'\n")
    with pytest.raises(ConfigError):
        build_spec(strict=True)
    assert build_spec(strict=False).stop_timeout_seconds == 10 + STOP_MARGIN_SECONDS


def test_no_secret_from_the_environment_reaches_the_plist(monkeypatch: pytest.MonkeyPatch):
    secrets = {"MTPLX_API_KEY": "sk-mtplx-secret", "HF_TOKEN": "hf_secret", "OPENAI_API_KEY": "sk-openai"}
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    content = render_plist(build_spec())
    for name, value in secrets.items():
        assert name.encode() not in content and value.encode() not in content
    assert set(plistlib.loads(content)["EnvironmentVariables"]) == {"MTPLX_HOME", "MTPLX_SUPERVISOR", "PATH"}


def test_problems_names_what_launchd_would_reject():
    plist = build_plist(build_spec())
    plist["ProgramArguments"] = ["python", "-m", "mtplxd"]
    plist["KeepAlive"] = "yes"
    plist["ExitTimeOut"] = -1
    plist["StandardOutPath"] = "~/mtplxd.out"
    problems = " | ".join(plist_problems(plist))
    for key in ("ProgramArguments[0]", "KeepAlive", "ExitTimeOut", "StandardOutPath"):
        assert key in problems
