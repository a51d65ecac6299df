"""The Linux hwmon backend against a fake sysfs tree."""

from __future__ import annotations

from pathlib import Path

import pytest

from mtplxd.fans.backends import make_backend, restore_record
from mtplxd.fans.base import FanError
from mtplxd.fans.hwmon import HwmonBackend
from mtplxd.fans.null import NullBackend


def test_max_sets_manual_full_duty_and_restore_writes_the_original_mode_back(hwmon):
    backend = HwmonBackend(hwmon.root)
    record = backend.snapshot()
    backend.apply_max()
    assert (hwmon.attr("pwm1_enable"), hwmon.attr("pwm1")) == ("1", "255")
    restore_record(record)
    assert hwmon.attr("pwm1_enable") == "2"


def test_an_original_manual_mode_gets_its_duty_back(hwmon):
    hwmon.write("pwm1_enable", "1")
    hwmon.write("pwm1", "90")
    backend = HwmonBackend(hwmon.root)
    record = backend.snapshot()
    backend.apply_max()
    backend.restore(record)
    assert (hwmon.attr("pwm1_enable"), hwmon.attr("pwm1")) == ("1", "90")


def test_a_non_default_automatic_mode_is_restored_exactly(hwmon):
    hwmon.write("pwm1_enable", "5")
    backend = HwmonBackend(hwmon.root)
    record = backend.snapshot()
    backend.apply_max()
    backend.restore(record)
    assert hwmon.attr("pwm1_enable") == "5"


def test_restore_leaves_a_renumbered_device_alone(hwmon):
    backend = HwmonBackend(hwmon.root)
    record = backend.snapshot()
    backend.apply_max()
    hwmon.write("name", "amdgpu")
    backend.restore(record)
    assert hwmon.attr("pwm1_enable") == "1"


def test_read_reports_speed_mode_and_temperature(hwmon):
    readings = HwmonBackend(hwmon.root).read().to_dict()
    assert {"name": "nct6775 fan1", "rpm": 1200.0}.items() <= readings["fans"][0].items()
    assert readings["fans"][1]["mode"] == "auto"
    assert readings["temperatures"] == [{"name": "nct6775 CPUTIN", "celsius": 45.0}]


def test_an_unwritable_pwm_enable_is_a_fan_error_that_names_the_file(hwmon, make_unwritable):
    make_unwritable(hwmon.device / "pwm1_enable")
    backend = HwmonBackend(hwmon.root)
    record = backend.snapshot()
    with pytest.raises(FanError, match="pwm1_enable.*docs/fans.md"):
        backend.apply_max()
    backend.restore(record)  # nothing changed, so nothing needs writing
    assert hwmon.attr("pwm1_enable") == "2"


def test_auto_backend_without_pwm_fans_is_null_and_says_why(tmp_path):
    backend = make_backend("auto", tmp_path / "nothing", Path("/nonexistent"), platform="linux")
    assert isinstance(backend, NullBackend)
    assert not backend.available and "does not exist" in backend.reason
    with pytest.raises(FanError, match="cannot be controlled"):
        backend.snapshot()


def test_fan_backend_none_says_it_is_switched_off(hwmon):
    backend = make_backend("none", hwmon.root, Path("/nonexistent"))
    assert "fan_backend = none" in backend.reason


def test_unknown_backend_in_a_record_is_refused():
    with pytest.raises(FanError, match="unknown fan backend"):
        restore_record({"backend": "teapot"})


def test_null_backend_reads_nothing_where_psutil_has_no_sensors(monkeypatch):
    import psutil

    # macOS and Windows psutil have no sensors_temperatures / sensors_fans at all.
    monkeypatch.delattr(psutil, "sensors_temperatures", raising=False)
    monkeypatch.delattr(psutil, "sensors_fans", raising=False)
    readings = NullBackend("no fans here").read().to_dict()
    assert readings == {"fans": [], "temperatures": [], "temperature_source": None}
