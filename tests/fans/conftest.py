"""Fixtures of the fan tests: a fake hwmon tree, and files even root cannot write."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Callable, Iterator

import pytest


class FakeHwmon:
    """A fake /sys/class/hwmon: hwmon0 (nct6775) with one PWM fan in automatic mode (2)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.device = root / "hwmon0"
        self.device.mkdir(parents=True)
        for name, value in {"name": "nct6775", "pwm1_enable": "2", "pwm1": "128",
                            "fan1_input": "1200", "temp1_input": "45000",
                            "temp1_label": "CPUTIN"}.items():
            self.write(name, value)

    def attr(self, name: str) -> str:
        """One attribute of hwmon0, stripped."""
        return (self.device / name).read_text().strip()

    def write(self, name: str, value: str) -> None:
        (self.device / name).write_text(value + "\n")


@pytest.fixture
def hwmon(tmp_path: Path) -> FakeHwmon:
    """A fresh fake hwmon tree under the test's tmp dir."""
    return FakeHwmon(tmp_path / "hwmon")


@pytest.fixture
def make_unwritable() -> Iterator[Callable[[Path], None]]:
    """Make a file reject writes but stay readable: chmod for a user, `chattr +i` for root.

    `make_unwritable.thaw(path)` undoes it.
    """
    frozen: list[Path] = []

    def freeze(path: Path) -> None:
        if os.geteuid() != 0:
            path.chmod(0o444)
            return
        done = subprocess.run(["chattr", "+i", str(path)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot make a file read-only for root here: {done.stderr!r}")
        frozen.append(path)

    def thaw(path: Path) -> None:
        if os.geteuid() != 0:
            path.chmod(0o644)
        else:
            subprocess.run(["chattr", "-i", str(path)], check=True)

    freeze.thaw = thaw  # type: ignore[attr-defined]
    yield freeze
    for path in frozen:
        subprocess.run(["chattr", "-i", str(path)], check=False)
