"""Running `launchctl` and `systemctl`: found on PATH at call time, output captured, errors named.

PATH lookup (rather than /bin/launchctl) is what lets the tests put recording fakes first on PATH.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolResult:
    """One finished command: its argv, exit status and captured output."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str


NO_USER_MANAGER_HINT = ("run `loginctl enable-linger $USER` and log in again (a container or an "
                        "SSH login has no user session without it), or run without the service: "
                        "`mtplxctl start`")


class ServiceError(RuntimeError):
    """A service-manager command failed; the message names the command and says why."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint

    @classmethod
    def from_result(cls, result: ToolResult) -> "ServiceError":
        """The error for a command that exited non-zero, with a hint for the usual causes."""
        said = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()[-1]
        message = f"`{' '.join(result.argv)}` failed (exit {result.returncode}): {said}"
        return cls(message, _hint_for(result))


def run_tool(tool: str, *args: str, timeout: float = 60.0) -> ToolResult:
    """Run `tool args...` and capture its output; ServiceError when it is missing or hangs."""
    path = shutil.which(tool)
    if path is None:
        raise ServiceError(f"`{tool}` not found on PATH",
                           "this platform's service manager is not available here; "
                           "run the daemon with `mtplxctl start` instead")
    argv = [tool, *args]
    try:
        completed = subprocess.run([path, *args], capture_output=True, text=True, timeout=timeout,
                                   stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise ServiceError(f"`{' '.join(argv)}` did not finish within {timeout:.0f}s") from None
    return ToolResult(argv, completed.returncode, completed.stdout, completed.stderr)


def _hint_for(result: ToolResult) -> str | None:
    text = (result.stderr + result.stdout).lower()
    if result.argv[0] == "systemctl" and ("failed to connect to bus" in text
                                          or "xdg_runtime_dir" in text):
        return NO_USER_MANAGER_HINT
    if result.argv[0] == "launchctl":
        if "service is disabled" in text or result.returncode == 119:
            return "run `launchctl enable gui/$(id -u)/com.mtplx.mtplxd`, then install again"
        if result.returncode in (5, 125) or "input/output error" in text:
            return ("the gui domain exists only while you are logged in to the desktop; run the "
                    "install from a Terminal in that session (see docs/service.md)")
    return None
