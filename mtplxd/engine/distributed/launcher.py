"""Starting and stopping a group's workers with mlx.launch's own launch script.

Each worker rank is started the way `mlx.launch` starts a ring rank (its `make_launch_script`:
MLX_RANK, MLX_HOSTFILE in a temporary file, the host file's "envs", `exec python ...`),
locally with bash or over ssh for a remote host with mlx.launch's own ssh options (a forced
terminal, so the remote worker is hung up on when its ssh ends); rank 0 is the calling
process itself (the daemon), so it is not started here. The launcher keeps the processes to
report on them (a worker that exited, with its status) and to stop them all.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, IO

from mlx._distributed_utils.launch import RemoteProcess

from mtplxd.engine.distributed.hostfile import Host, HostFile, ring_addresses
from mtplxd.engine.distributed.link import DEFAULT_TIMEOUT_S, RING_BROKE

WORKER_MODULE = "mtplxd.engine.distributed.worker"
EXIT_GRACE_S = 1.0  # how long a lost group waits to name the worker that died
# mlx.launch's ssh (RemoteProcess); BatchMode: a host that wants a password fails at once
# instead of waiting for a prompt nobody sees.
SSH = ["ssh", "-tt", "-o", "LogLevel=QUIET", "-o", "BatchMode=yes"]


@dataclass
class WorkerProcess:
    """One started worker rank."""

    rank: int
    host: str
    process: subprocess.Popen
    log_path: Path
    log: IO[bytes]

    def state(self) -> dict[str, Any]:
        """rank, host, pid and whether it runs (or how it ended)."""
        code = self.process.poll()
        return {"rank": self.rank, "host": self.host, "pid": self.process.pid,
                "running": code is None, "exit_code": code, "log": str(self.log_path)}


class Workers:
    """The worker ranks of one group (ranks 1..n-1 of `hosts`)."""

    def __init__(self, hosts: HostFile, model: str, port: int, log_dir: Path,
                 python: str = sys.executable, env: dict[str, str] | None = None,
                 timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.hosts, self.model, self.port, self.timeout = hosts, model, port, timeout
        self.log_dir, self.python, self.env = Path(log_dir), python, env or {}
        self.ring = ring_addresses(hosts, port)
        self.procs: list[WorkerProcess] = []

    def start(self) -> None:
        """Start every worker rank (they then wait for rank 0 to join)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for rank, host in enumerate(self.hosts.hosts[1:], start=1):
            argv = self.launch_argv(rank, host)
            log_path = self.log_dir / f"rank{rank}.log"
            log = log_path.open("ab")
            # stdin stays an open pipe, as mlx.launch keeps it: with a forced terminal an
            # end of input could reach the remote side.
            process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=log, stderr=log,
                                       start_new_session=True)
            self.procs.append(WorkerProcess(rank, host.ssh, process, log_path, log))

    def launch_argv(self, rank: int, host: Host) -> list[str]:
        """The command that starts worker `rank` on `host`: mlx.launch's launch script, run
        by bash here or by the login shell of `host` over ssh."""
        # The worker's deadline without word from rank 0 is the group's exchange deadline.
        command = ["-m", WORKER_MODULE, "--model", host.model or self.model,
                   "--timeout", f"{self.timeout:g}"]
        env = list(self.hosts.envs) + [f"{k}={v}" for k, v in self.env.items()]
        script = RemoteProcess.make_launch_script(
            rank, host.python or self.python, None, {"MLX_HOSTFILE": self.ring}, env,
            command, host.is_local)
        return ["bash", "-c", script] if host.is_local else [*SSH, host.ssh, script]

    def states(self) -> list[dict[str, Any]]:
        """Each worker's state (see WorkerProcess.state)."""
        return [p.state() for p in self.procs]

    def describe_exits(self) -> str | None:
        """"rank 2 (127.0.0.1) exited with code -9; ..." for every worker that ended."""
        ended = [f"rank {s['rank']} ({s['host']}) exited with code {s['exit_code']}"
                 for s in self.states() if not s["running"]]
        return "; ".join(ended) or None

    def _exits_within(self, seconds: float) -> str | None:
        """describe_exits, waiting up to `seconds` for one: the ring can break (a peer killed
        mid-forward) a moment before the killed process is reaped."""
        until = time.monotonic() + seconds
        while (detail := self.describe_exits()) is None and time.monotonic() < until:
            time.sleep(0.05)
        return detail

    def on_lost(self, reason: str) -> str:
        """Link.on_lost: name what ended (or that every worker still runs: a hang), then
        stop them all, which also ends a receive rank 0 is stuck in."""
        # A broken ring means a peer is gone: give its exit a moment to show. A deadline
        # means one hangs: describe at once (a worker leaving later on its own deadline is
        # not the cause).
        grace = EXIT_GRACE_S if reason.startswith(RING_BROKE) else 0.0
        detail = self._exits_within(grace) or "every worker process still runs: one stopped answering"
        self.stop(grace=2.0)
        return detail

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM every worker, SIGKILL what is left after `grace` seconds."""
        for proc in self.procs:
            if proc.process.poll() is None:
                _signal(proc.process, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                _signal(proc.process, signal.SIGKILL)
                proc.process.wait()
            proc.log.close()
            if proc.process.stdin is not None:
                proc.process.stdin.close()


def _signal(process: subprocess.Popen, sig: int) -> None:
    # The worker runs in its own session (its own process group): signal the whole group,
    # so a stopped (SIGSTOP) worker is also continued and killed.
    try:
        os.killpg(process.pid, sig)
        if sig == signal.SIGTERM:
            os.killpg(process.pid, signal.SIGCONT)
    except ProcessLookupError:
        pass

