"""A recording fake of macOS `launchctl` (modern verbs) that really runs the job.

bootstrap reads the plist like launchd: ProgramArguments with EnvironmentVariables (on top of
launchd's minimal environment plus XPC_SERVICE_NAME=<Label>), stdout/stderr to
StandardOutPath, started at once when RunAtLoad is set. bootout sends SIGTERM and SIGKILL after
ExitTimeOut, then forgets the job. print answers in launchctl's own format. `kickstart -k` is
refused loudly: it SIGKILLs the daemon and must never be used.
"""

from __future__ import annotations

import json
import os
import plistlib
import sys
from pathlib import Path

import common

LAUNCHD_BASE_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"


def _jobs() -> Path:
    return common.state_dir() / "launchd"


def _job_dir(label: str) -> Path:
    return _jobs() / label


def _loaded(label: str) -> dict | None:
    try:
        return plistlib.loads((_job_dir(label) / "loaded.plist").read_bytes())
    except FileNotFoundError:
        return None


def _disabled() -> dict[str, bool]:
    try:
        return json.loads((_jobs() / "disabled.json").read_text())
    except FileNotFoundError:
        return {}


def _set_disabled(label: str, disabled: bool) -> None:
    _jobs().mkdir(parents=True, exist_ok=True)
    state = _disabled()
    state[label] = disabled
    (_jobs() / "disabled.json").write_text(json.dumps(state))


def _launch(plist: dict) -> None:
    label = plist["Label"]
    env = {"PATH": LAUNCHD_BASE_PATH, "HOME": os.environ["HOME"], "XPC_SERVICE_NAME": label,
           "HF_HUB_OFFLINE": "1", **plist.get("EnvironmentVariables", {})}
    common.start(_job_dir(label) / "proc", plist["ProgramArguments"], env,
                 plist.get("StandardOutPath"))


def _target_label(target: str) -> str:
    return target.rsplit("/", 1)[-1]


def cmd_bootstrap(domain: str, path: str) -> int:
    plist = plistlib.loads(Path(path).read_bytes())
    label = plist["Label"]
    if _loaded(label) is not None:
        print("Bootstrap failed: 5: Input/output error", file=sys.stderr)
        return 5
    if _disabled().get(label):
        print("Bootstrap failed: 119: Service is disabled", file=sys.stderr)
        return 119
    _job_dir(label).mkdir(parents=True, exist_ok=True)
    (_job_dir(label) / "loaded.plist").write_bytes(Path(path).read_bytes())
    (_job_dir(label) / "path").write_text(path)
    if plist.get("RunAtLoad"):
        _launch(plist)
    return 0


def cmd_bootout(target: str) -> int:
    label = _target_label(target)
    plist = _loaded(label)
    if plist is None:
        print("Boot-out failed: 3: No such process", file=sys.stderr)
        return 3
    common.stop(_job_dir(label) / "proc", float(plist.get("ExitTimeOut", 5)))
    (_job_dir(label) / "loaded.plist").unlink()
    return 0


def cmd_kickstart(args: list[str]) -> int:
    if "-k" in args:
        print("fake launchctl: kickstart -k SIGKILLs the daemon; mtplx must never use it",
              file=sys.stderr)
        return 99
    label = _target_label(args[-1])
    plist = _loaded(label)
    if plist is None:
        print(f'Could not find service "{label}" in domain for port', file=sys.stderr)
        return 113
    if common.main_pid(_job_dir(label) / "proc") is None:
        _launch(plist)
    return 0


def cmd_print(target: str) -> int:
    label = _target_label(target)
    plist = _loaded(label)
    if plist is None:
        print(f'Could not find service "{label}" in domain for port', file=sys.stderr)
        return 113
    proc = _job_dir(label) / "proc"
    pid = common.main_pid(proc)
    status = common.exit_status(proc)
    runs_file = proc / "runs"
    runs = int(runs_file.read_text()) if runs_file.exists() else 0
    domain = target.rsplit("/", 1)[0]
    lines = [f"{target} = {{", f"\tactive count = {1 if pid else 0}",
             f"\tpath = {(_job_dir(label) / 'path').read_text()}", "\ttype = LaunchAgent",
             f"\tstate = {'running' if pid else 'not running'}", "",
             f"\tprogram = {plist['ProgramArguments'][0]}", "\targuments = {",
             *[f"\t\t{arg}" for arg in plist["ProgramArguments"]], "\t}", "",
             f"\tstdout path = {plist.get('StandardOutPath')}",
             f"\tstderr path = {plist.get('StandardErrorPath')}",
             "\tdefault environment = {", f"\t\tPATH => {LAUNCHD_BASE_PATH}", "\t}", "",
             "\tenvironment = {",
             *[f"\t\t{k} => {v}" for k, v in plist.get("EnvironmentVariables", {}).items()],
             f"\t\tXPC_SERVICE_NAME => {label}", "\t}", "",
             f"\tdomain = {domain} [100005]", "\tasid = 100005",
             f"\tminimum runtime = {plist.get('ThrottleInterval', 10)}",
             f"\texit timeout = {plist.get('ExitTimeOut', 5)}", f"\truns = {runs}"]
    if pid:
        lines += [f"\tpid = {pid}", "\timmediate reason = speculative"]
    if status is not None and status < 0:
        lines.append(f"\tlast terminating signal = Terminated: {-status}")
    else:
        lines.append(f"\tlast exit code = {'(never exited)' if status is None else status}")
    lines += ["", "\tspawn type = interactive (4)", "\tjetsam priority = 40",
              "\tproperties = keepalive | runatload | inferred program", "}"]
    print("\n".join(lines))
    return 0


def cmd_print_disabled(domain: str) -> int:
    print("disabled services = {")
    print('\t"com.apple.ftpd" => disabled')
    for label, disabled in _disabled().items():
        print(f'\t"{label}" => {"disabled" if disabled else "enabled"}')
    print("}")
    return 0


def main(argv: list[str]) -> int:
    common.record("launchctl", argv)
    verb, args = argv[0], argv[1:]
    failure = common.injected_failure("launchctl", verb)
    if failure is not None:
        print(failure[1], file=sys.stderr)
        return failure[0]
    if verb in ("load", "unload", "start", "stop", "remove", "submit"):
        print(f"fake launchctl: legacy verb {verb!r} is not allowed", file=sys.stderr)
        return 98
    if verb == "bootstrap":
        return cmd_bootstrap(args[0], args[1])
    if verb == "bootout":
        return cmd_bootout(args[0])
    if verb == "kickstart":
        return cmd_kickstart(args)
    if verb == "print":
        return cmd_print(args[0])
    if verb == "print-disabled":
        return cmd_print_disabled(args[0])
    if verb in ("enable", "disable"):
        _set_disabled(_target_label(args[0]), verb == "disable")
        return 0
    print(f"fake launchctl: unknown verb {verb!r}", file=sys.stderr)
    return 64
