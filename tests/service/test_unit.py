"""The systemd user unit: content, quoting, and where it is written."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from mtplxctl.launchd.spec import STOP_MARGIN_SECONDS, build_spec
from mtplxctl.launchd.systemd import user_unit_dir
from mtplxctl.launchd.unit import parse_unit, render_unit, unit_environment, unit_words


def test_unit_has_notify_restart_timeouts_environment_and_logs(isolated_home: Path):
    text = render_unit(build_spec())
    unit = parse_unit(text)
    assert "[Unit]" in text and "[Service]" in text and "[Install]" in text
    assert unit["Type"] == ["notify"] and unit["NotifyAccess"] == ["main"]
    assert unit["Restart"] == ["on-failure"]
    assert int(unit["TimeoutStopSec"][0]) == 10 + STOP_MARGIN_SECONDS
    assert unit["StartLimitBurst"] == ["5"] and unit["StartLimitIntervalSec"] == ["300"]
    assert unit_words(unit["ExecStart"][0], dollar=True) == [os.path.abspath(sys.executable), "-m", "mtplxd"]
    # After any exit, a crash included, systemd gives pinned fans back (tests/fans covers the
    # command itself); "-" keeps a failed restore from blocking the restart.
    [stop_post] = unit["ExecStopPost"]
    assert stop_post.startswith("-")
    assert unit_words(stop_post[1:], dollar=True) == [os.path.abspath(sys.executable), "-m", "mtplxctl",
                                                      "fans", "restore"]
    assert unit_environment(unit) == {"MTPLX_HOME": str(isolated_home), "MTPLX_SUPERVISOR": "systemd"}
    log = f"append:{isolated_home / 'logs' / 'mtplxd.out'}"
    assert unit["StandardOutput"] == [log] and unit["StandardError"] == [log]
    assert unit["WantedBy"] == ["default.target"]


def test_awkward_paths_survive_systemd_quoting(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    home = tmp_path / 'my "models" 100% $HOME\\x'
    monkeypatch.setenv("MTPLX_HOME", str(home))
    unit = parse_unit(render_unit(build_spec()))
    assert unit_environment(unit)["MTPLX_HOME"] == str(home)
    assert "%%" in unit["Environment"][0]  # a bare % would be read as a specifier


def test_exec_start_doubles_dollars_and_percents():
    spec = build_spec()
    spec = type(spec)(**{**spec.__dict__, "program": ["/opt/py 3$/python%", "-m", "mtplxd"]})
    value = parse_unit(render_unit(spec))["ExecStart"][0]
    assert "$$" in value and "%%" in value
    assert unit_words(value, dollar=True) == ["/opt/py 3$/python%", "-m", "mtplxd"]


def test_unit_dir_follows_xdg_config_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    assert user_unit_dir() == Path.home() / ".config" / "systemd" / "user"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    assert user_unit_dir() == tmp_path / "cfg" / "systemd" / "user"
    monkeypatch.setenv("XDG_CONFIG_HOME", "relative/ignored")
    assert user_unit_dir() == Path.home() / ".config" / "systemd" / "user"
