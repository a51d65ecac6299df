"""The wheel installs exactly two top-level packages, with agents/ and launchd/ under mtplxctl."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _build_wheel(out: Path) -> Path:
    # pip builds in the tree; setuptools never prunes build/lib, so a module deleted since the
    # last build would still be packed. Start from a clean build folder (it is git-ignored).
    shutil.rmtree(ROOT / "build", ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out), str(ROOT)], check=True, timeout=600)
    [wheel] = out.glob("mtplx-*.whl")
    return wheel


def _source_packages() -> set[str]:
    """Every package folder in the tree, as the import name the wheel must give it."""
    mapped = {"agents": "mtplxctl.agents", "launchd": "mtplxctl.launchd"}
    names = set()
    for init in ROOT.glob("*/**/__init__.py"):
        parts = init.parent.relative_to(ROOT).parts
        if parts[0] in {"mtplxd", "mtplxctl"}:
            names.add(".".join(parts))
        elif parts[0] in mapped:
            names.add(".".join((mapped[parts[0]], *parts[1:])))
    return names


def test_wheel_top_level_names_are_exactly_mtplxd_and_mtplxctl(tmp_path):
    wheel = _build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        [top_level] = [n for n in names if n.endswith(".dist-info/top_level.txt")] or [None]
        entry_points = archive.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    roots = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert roots == {"mtplxd", "mtplxctl"}
    if top_level:
        with zipfile.ZipFile(wheel) as archive:
            assert set(archive.read(top_level).decode().split()) <= {"mtplxd", "mtplxctl"}
    assert "mtplxctl/agents/__init__.py" in names and "mtplxctl/launchd/__init__.py" in names
    # The chat page is served from the package: its files must travel in the wheel.
    assert {f"mtplxd/api/static/{f}" for f in ("index.html", "chat.js", "chat.css", "markdown.js")} <= set(names)
    packaged = {"/".join(n.split("/")[:-1]).replace("/", ".") for n in names if n.endswith("/__init__.py")}
    missing = _source_packages() - packaged
    assert not missing, f"packages missing from pyproject's list: {sorted(missing)}"
    assert "mtplxd = mtplxd.__main__:entry" in entry_points
    assert "mtplxctl = mtplxctl.__main__:main" in entry_points


def test_version_shows_powered_by_mtplx():
    for module in ("mtplxctl", "mtplxd"):
        result = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 0
        assert "Powered by MTPLX" in result.stdout
