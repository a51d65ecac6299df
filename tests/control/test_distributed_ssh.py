"""A group whose worker is started over a real ssh connection, the path `mlx.launch` (and
mtplx's launcher) takes for a remote host: a private sshd on a loopback port (its own config,
host key and key-only login, in the test's temporary folder), a host file naming the worker
`USER@127.0.0.1` (a name that is not local, so it goes over ssh), `mtplxctl start --hosts`, one
OpenAI SDK request answered as the single process answers it, `mtplxctl stop` leaving no
worker behind.

Skipped, saying why, where `sshd` is not installed (CI does not install it); docs/distributed.md
says how to run it. ssh reads its client settings (port, key, known host) from a config file
that a wrapper named `ssh`, first on the daemon's PATH, passes with `-F`: the launcher runs
`ssh` by name, as mlx.launch does, and the user's own ~/.ssh is never touched.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import mtplxd
from mtplxd.engine.fixtures.tiny import write_tiny_checkpoint

from support.daemon import greedy_completion, run_ctl, single_process_text
from support.waiting import wait_for, wait_gone

SSHD = shutil.which("sshd") or next(
    (p for p in ("/usr/sbin/sshd", "/usr/local/sbin/sshd") if os.access(p, os.X_OK)), None)
SSH = shutil.which("ssh")
SSH_KEYGEN = shutil.which("ssh-keygen")

pytestmark = pytest.mark.skipif(
    not (SSHD and SSH and SSH_KEYGEN),
    reason="needs OpenSSH's sshd, ssh and ssh-keygen (e.g. apt-get install openssh-server); "
           "CI does not install them")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _keygen(path: Path) -> str:
    subprocess.run([SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return path.with_suffix(".pub").read_text().strip()


@pytest.fixture
def loopback_sshd(tmp_path):
    """A private sshd on 127.0.0.1 that lets this user in with a generated key; yields the
    folder holding an `ssh` wrapper that reaches it (put it first on PATH)."""
    folder = tmp_path / "ssh"
    folder.mkdir(mode=0o700)
    port = _free_port()
    host_key = _keygen(folder / "host_key")
    (folder / "authorized_keys").write_text(_keygen(folder / "client_key") + "\n")
    (folder / "known_hosts").write_text(f"[127.0.0.1]:{port} {host_key}\n")
    (folder / "sshd_config").write_text(f"""\
Port {port}
ListenAddress 127.0.0.1
HostKey {folder / 'host_key'}
PidFile {folder / 'sshd.pid'}
AuthorizedKeysFile {folder / 'authorized_keys'}
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
UsePAM no
StrictModes no
""")
    (folder / "ssh_config").write_text(f"""\
Host 127.0.0.1
  Port {port}
  IdentityFile {folder / 'client_key'}
  IdentitiesOnly yes
  UserKnownHostsFile {folder / 'known_hosts'}
  StrictHostKeyChecking yes
""")
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "ssh"
    wrapper.write_text(f'#!/bin/sh\nexec {SSH} -F {folder / "ssh_config"} "$@"\n')
    wrapper.chmod(0o755)
    # sshd wants its privilege-separation folder; as root, make it when the package did not.
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    log = (folder / "sshd.log").open("wb")
    sshd = subprocess.Popen([SSHD, "-D", "-e", "-f", str(folder / "sshd_config")],
                            stdout=log, stderr=log)
    try:
        login = [str(wrapper), "-o", "BatchMode=yes", f"{getpass.getuser()}@127.0.0.1", "true"]
        up = wait_for(lambda: subprocess.run(login, capture_output=True).returncode == 0, 20)
        if up is None:
            why = f"sshd did not let the test in: {(folder / 'sshd.log').read_text()[-2000:]}"
            # As another user than root, sshd may lack what it needs (its privilege-separation
            # folder, the right to switch users): the machine's, not mtplx's, limit.
            (pytest.fail if os.geteuid() == 0 else pytest.skip)(why)
        yield bin_dir
    finally:
        sshd.terminate()
        sshd.wait(10)
        log.close()


def _workers_of(model: Path) -> list[int]:
    """Pids of worker processes serving `model` (started by sshd, not by the daemon)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                if b"mtplxd.engine.distributed.worker" in argv and str(model).encode() in argv:
                    pids.append(int(entry.name))
    return pids


def test_a_worker_started_over_real_ssh_serves_an_openai_request_as_one_process(
        tmp_path, loopback_sshd, monkeypatch):
    model_path = write_tiny_checkpoint(tmp_path / "tiny4", "qwen3", num_hidden_layers=4)
    repo = Path(mtplxd.__file__).resolve().parents[1]
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps({
        "backend": "ring",
        # The worker's shell comes from sshd, not from this process: it gets the import path
        # of the mtplx under test the way mlx.launch passes settings, through "envs".
        "envs": [f"PYTHONPATH={repo}"],
        "hosts": [{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]},
                  {"ssh": f"{getpass.getuser()}@127.0.0.1", "ips": ["127.0.0.1"],
                   "python": sys.executable}]}))
    monkeypatch.setenv("PATH", f"{loopback_sshd}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("MTPLX_GROUP_PORT", "0")
    monkeypatch.setenv("MTPLX_GROUP_TIMEOUT_SECONDS", "20")
    began = time.monotonic()
    started = run_ctl("start", "--port", "0", "--model", str(model_path), "--hosts", str(hosts),
                      "--json", timeout=180)
    assert started.returncode == 0, started.stderr + started.stdout
    status = json.loads(started.stdout)
    daemon_pid = status["pid"]
    workers: list[int] = []
    try:
        start_seconds = time.monotonic() - began
        group = json.loads(run_ctl("status", "--json").stdout)["group"]
        assert group["ranks"][1]["running"]
        # Two logins: the fixture's check, then the worker's launch.
        assert (loopback_sshd.parent / "sshd.log").read_text().count("Accepted publickey") == 2
        workers = _workers_of(model_path)
        assert len(workers) == 1
        # Started by sshd's session, not by the daemon (whose child is the ssh client).
        assert Path(f"/proc/{workers[0]}/status").read_text().count(f"PPid:\t{daemon_pid}\n") == 0

        prompt = "def add(a, b):"
        answer = greedy_completion(status["http"]["base_url"], "tiny4", prompt, 12)
        assert answer == single_process_text(model_path, prompt, 12)
        print(f"ssh group: started in {start_seconds:.1f} s; link {group['link']}; "
              f"answer {answer!r} equals the single process's")
    finally:
        stopped = run_ctl("stop")
        for pid in workers:  # a worker the stop missed must not outlive the test
            if not wait_gone(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    assert stopped.returncode == 0, stopped.stderr
    assert wait_gone(daemon_pid)
    assert all(wait_gone(pid) for pid in workers), "a worker outlived mtplxctl stop"
