"""Starting and stopping a group's workers with mlx.launch's own launch script.

Each worker rank is started the way `mlx.launch` starts a ring rank (its `make_launch_script`:
MLX_RANK, MLX_HOSTFILE in a temporary file, `exec python ...`), locally with bash or over ssh
for a remote host; rank 0 is the calling process itself (the daemon), so it is not started
here. The launcher keeps the processes to report on them (a worker that exited, with its
status) and to stop them all.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, IO

from mlx._distributed_utils.launch import RemoteProcess

from mtplxd.engine.distributed.hostfile import HostFile, ring_addresses

WORKER_MODULE = "mtplxd.engine.distributed.worker"


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
                 python: str = sys.executable, env: dict[str, str] | None = None) -> None:
        self.hosts, self.model, self.port = hosts, model, port
        self.log_dir, self.python, self.env = Path(log_dir), python, env or {}
        self.ring = ring_addresses(hosts, port)
        self.procs: list[WorkerProcess] = []

    def start(self) -> None:
        """Start every worker rank (they then wait for rank 0 to join)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for rank, host in enumerate(self.hosts.hosts[1:], start=1):
            command = ["-m", WORKER_MODULE, "--model", host.model or self.model]
            env = [f"{k}={v}" for k, v in self.env.items()]
            script = RemoteProcess.make_launch_script(
                rank, host.python or self.python, None, {"MLX_HOSTFILE": self.ring}, env,
                command, host.is_local)
            argv = (["bash", "-c", script] if host.is_local
                    else ["ssh", "-o", "BatchMode=yes", host.ssh, script])
            log_path = self.log_dir / f"rank{rank}.log"
            log = log_path.open("ab")
            process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                       start_new_session=True)
            self.procs.append(WorkerProcess(rank, host.ssh, process, log_path, log))

    def states(self) -> list[dict[str, Any]]:
        """Each worker's state (see WorkerProcess.state)."""
        return [p.state() for p in self.procs]

    def describe_exits(self) -> str | None:
        """"rank 2 (127.0.0.1) exited with code -9; ..." for every worker that ended."""
        ended = [f"rank {s['rank']} ({s['host']}) exited with code {s['exit_code']}"
                 for s in self.states() if not s["running"]]
        return "; ".join(ended) or None

    def on_lost(self, reason: str) -> str:
        """Link.on_lost: name what ended (or that every worker still runs: a hang), then
        stop them all, which also ends a receive rank 0 is stuck in."""
        detail = self.describe_exits() or "every worker process still runs: one stopped answering"
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


def _signal(process: subprocess.Popen, sig: int) -> None:
    # The worker runs in its own session (its own process group): signal the whole group,
    # so a stopped (SIGSTOP) worker is also continued and killed.
    try:
        os.killpg(process.pid, sig)
        if sig == signal.SIGTERM:
            os.killpg(process.pid, signal.SIGCONT)
    except ProcessLookupError:
        pass

