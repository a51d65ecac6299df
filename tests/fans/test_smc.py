"""The macOS SMC backend's contract with its helper, against a fake helper (no SMC on Linux)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from mtplxd.fans.backends import make_backend, restore_record
from mtplxd.fans.base import FanError
from mtplxd.fans.null import NullBackend
from mtplxd.fans.smc import SmcBackend, parse_status

# Speaks the helper contract (status JSON, max, auto) over a state file next to it, the way the
# real helper speaks it over SMC keys: F0Md 3 (system) at rest, 1 (manual) after `max`.
FAKE_HELPER = '''\
import json, pathlib, sys
here = pathlib.Path(__file__).parent
state_file = here / "state.json"
state = json.loads(state_file.read_text())
verb = sys.argv[1]
with open(here / "calls.log", "a") as log:
    log.write(verb + "\\n")
if state.get("fail"):
    print("SMC write error 0x82", file=sys.stderr)
    sys.exit(3)
if verb == "status":
    manual = state["mode"] == 1
    fan = {"actual_rpm": 6500.0 if manual else 1300.0, "target_rpm": 6500.0 if manual else 0,
           "min_rpm": 1300.0, "max_rpm": 6500.0, "mode": state["mode"]}
    print(json.dumps({"fans": [fan, dict(fan)], "temperatures": {"TC0P": 61.5}}))
elif verb == "max":
    state["mode"] = 1
elif verb == "auto" and not state.get("stuck"):
    state["mode"] = 3
state_file.write_text(json.dumps(state))
'''


@pytest.fixture
def helper(tmp_path: Path) -> Path:
    path = tmp_path / "mtplx-fan-helper"
    path.write_text(f"#!{sys.executable}\n{FAKE_HELPER}")
    path.chmod(0o755)
    (tmp_path / "state.json").write_text(json.dumps({"mode": 3}))
    return path


def _state(helper: Path) -> dict:
    return json.loads((helper.parent / "state.json").read_text())


def _calls(helper: Path) -> list[str]:
    return (helper.parent / "calls.log").read_text().split()


def test_max_then_restore_through_the_helper_is_verified_by_status(helper):
    backend = SmcBackend(helper, sudo=False)
    record = backend.snapshot()
    assert record == {"backend": "smc", "helper": str(helper), "sudo": False}
    backend.apply_max()
    assert _state(helper)["mode"] == 1
    assert [fan.mode for fan in backend.read().fans] == ["manual", "manual"]
    restore_record(record)
    assert _state(helper)["mode"] == 3
    assert _calls(helper) == ["max", "status", "status", "auto", "status"]


def test_a_helper_that_says_ok_but_leaves_fans_pinned_is_an_error(helper):
    backend = SmcBackend(helper, sudo=False, verify_timeout=0.5)
    backend.apply_max()
    state = _state(helper)
    state["stuck"] = True
    (helper.parent / "state.json").write_text(json.dumps(state))
    with pytest.raises(FanError, match="did not reach auto"):
        backend.restore(backend.snapshot())


def test_a_failing_helper_reports_its_exit_code_and_message(helper):
    (helper.parent / "state.json").write_text(json.dumps({"mode": 3, "fail": True}))
    with pytest.raises(FanError, match="exited 3: SMC write error 0x82"):
        SmcBackend(helper, sudo=False).apply_max()


def test_sudo_failures_point_at_the_sudoers_rule(helper, monkeypatch):
    monkeypatch.setenv("PATH", str(helper.parent))  # `sudo` is not found: same path as no rule
    with pytest.raises(FanError, match="sudo -n"):
        SmcBackend(helper, sudo=True).read()


def test_readings_carry_rpm_and_smc_temperatures(helper):
    readings = SmcBackend(helper, sudo=False).read().to_dict()
    assert readings["fans"][0]["rpm"] == 1300.0 and readings["fans"][0]["max_rpm"] == 6500.0
    assert readings["temperatures"] == [{"name": "TC0P", "celsius": 61.5}]
    assert readings["temperature_source"] == "smc"


def test_temperatures_may_also_come_as_a_list():
    readings = parse_status({"fans": [], "temperatures": [{"name": "TC0P", "value": 70}]})
    assert readings.temperatures[0].celsius == 70.0


def test_missing_helper_on_macos_is_null_backend_naming_the_path(tmp_path):
    missing = tmp_path / "mtplx-fan-helper"
    backend = make_backend("auto", tmp_path, missing, platform="darwin")
    assert isinstance(backend, NullBackend)
    assert str(missing) in backend.reason and "docs/fans.md" in backend.reason
