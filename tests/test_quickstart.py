"""docs/quickstart.md runs as written: its shell blocks, in order, in one bash, the way a new
user pastes them after the README's set-up (as .ci/run runs the README's test command)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from support.daemon import run_ctl

QUICKSTART = Path(__file__).resolve().parents[1] / "docs" / "quickstart.md"

# Commands (or the leading part of an `&&` chain) the test leaves out, and why.
SKIPPED = {
    "git clone <this repository> mtplx && cd mtplx": "needs the network; the test runs in a checkout",
    "python3 -m venv .venv && .venv/bin/pip install -e . &&":
        "the test runs in a venv already installed this way (CI makes it as the README says)",
    "mtplxctl logs -f": "follows the log until Ctrl-C",
}
# Placeholders the page asks the reader to fill in, and what the test fills in.
PLACEHOLDER = "/path/to/a/model/folder"


def shell_blocks(markdown: str) -> list[str]:
    """The ```sh blocks of a markdown page, in order."""
    return re.findall(r"```sh\n(.*?)```", markdown, flags=re.S)


def runnable(block: str, model: Path) -> tuple[str, list[str]]:
    """The block with SKIPPED commands left out (commented, with the reason) and placeholders
    filled in; also returns what was skipped."""
    lines, skipped = [], []
    for line in block.splitlines():
        for command, why in SKIPPED.items():
            if line.startswith(command):
                skipped.append(command)
                rest = line[len(command):].strip()
                line = f"{rest}  # skipped: {command} ({why})" if rest else f"# skipped: {why}"
        lines.append(line.replace(PLACEHOLDER, str(model)))
    return "\n".join(lines), skipped


def test_quickstart_commands_run_in_order_after_the_readme_set_up(tmp_path, tiny_model_factory):
    checkout = tmp_path / "mtplx"
    checkout.mkdir()
    (checkout / ".venv").symlink_to(sys.prefix)  # the README's venv, installed
    model = tiny_model_factory("qwen3")
    scripts, skipped = [], []
    for block in shell_blocks(QUICKSTART.read_text()):
        script, left_out = runnable(block, model)
        scripts.append(script)
        skipped += left_out
    assert sorted(set(skipped)) == sorted(SKIPPED), "a skipped command is no longer in the quickstart"
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    # A shell that has not activated the venv: the page itself must put mtplxctl on PATH.
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep)
                                  if not p.startswith(sys.prefix))
    try:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", "\n".join(scripts)], cwd=checkout,
                              env=env, capture_output=True, text=True, timeout=240)
    finally:
        run_ctl("stop")
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"^http://127\.0\.0\.1:\d+$", done.stdout, flags=re.M), done.stdout
    assert '"object":"chat.completion"' in done.stdout.replace(" ", ""), done.stdout
    assert "stopped" in done.stdout or "mtplxd stopped" in done.stdout + done.stderr, done.stdout
