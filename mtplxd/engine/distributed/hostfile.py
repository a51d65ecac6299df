"""The user's hosts.json and the ring addresses MLX distributed connects over.

hosts.json is mlx.launch's host file, so one file serves both tools:
    {"backend": "ring", "hosts": [{"ssh": "mac-a.local", "ips": ["10.0.0.1"]},
                                  {"ssh": "mac-b.local", "ips": ["10.0.0.2"]}]}
(a bare list of host entries is accepted too). The first host is rank 0: the machine the
daemon runs on. Optional keys per host: "model" (the folder on that host, when it is not the
same path as on rank 0) and "python" (the interpreter with mtplx installed there); optional
top-level "envs" ("KEY=value" strings every rank gets, as mlx.launch gives them) and
"parallel": "pipeline" (the default: layers split across ranks) or "tensor" (every layer split
across ranks with the family's `shard()`; see tensor.py).
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_PORT = 32323  # mlx.launch's default starting port
PARALLEL_CHOICES = ("pipeline", "tensor")
LOCAL_NAMES = {"127.0.0.1", "localhost", "::1"}


@dataclass(frozen=True)
class Host:
    """One rank's host: where to ssh, the IPs the ring uses, optional per-host overrides."""

    ssh: str
    ips: tuple[str, ...]
    model: str | None = None
    python: str | None = None

    @property
    def is_local(self) -> bool:
        """True when the rank runs on this machine (started without ssh)."""
        return self.ssh in LOCAL_NAMES


@dataclass(frozen=True)
class HostFile:
    """The parsed host file: hosts in rank order and the backend."""

    hosts: list[Host]
    backend: str = "ring"
    envs: tuple[str, ...] = ()
    parallel: str = "pipeline"

    @property
    def size(self) -> int:
        """How many ranks the group has."""
        return len(self.hosts)


def parse_hosts(data: Any) -> HostFile:
    """A HostFile from the decoded JSON of hosts.json; ValueError naming what is wrong."""
    if isinstance(data, list):
        data = {"hosts": data}
    if not isinstance(data, dict) or not isinstance(data.get("hosts"), list):
        raise ValueError('hosts.json must be {"hosts": [{"ssh": ..., "ips": [...]}, ...]}')
    backend = data.get("backend") or "ring"
    if backend != "ring":
        raise ValueError(f"backend {backend!r} is not supported yet; use \"ring\"")
    hosts = []
    for i, entry in enumerate(data["hosts"]):
        if not isinstance(entry, dict) or not isinstance(entry.get("ssh"), str):
            raise ValueError(f"host {i}: each host needs an \"ssh\" name")
        ips = entry.get("ips") or ([entry["ssh"]] if _is_ip(entry["ssh"]) else [])
        if not ips or not all(isinstance(ip, str) and _is_ip(ip) for ip in ips):
            raise ValueError(f"host {i} ({entry['ssh']}): the ring backend needs \"ips\" (IP addresses)")
        hosts.append(Host(entry["ssh"], tuple(ips), entry.get("model"), entry.get("python")))
    if len(hosts) < 2:
        raise ValueError("a distributed group needs at least two hosts")
    if len({len(h.ips) for h in hosts}) > 1:
        raise ValueError("every host needs the same number of \"ips\" (the ring connects the "
                         "i-th address of each rank to the i-th of the next)")
    envs = data.get("envs") or []
    if not all(isinstance(e, str) and "=" in e for e in envs):
        raise ValueError('"envs" must be a list of "KEY=value" strings')
    parallel = data.get("parallel") or "pipeline"
    if parallel not in PARALLEL_CHOICES:
        raise ValueError(f'"parallel" must be "pipeline" or "tensor", got {parallel!r}')
    return HostFile(hosts, backend, tuple(envs), parallel)


def read_hosts(path: str | Path) -> HostFile:
    """Parse the host file at `path`."""
    try:
        data = json.loads(Path(path).expanduser().read_text())
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None
    return parse_hosts(data)


def ring_addresses(hosts: HostFile, port: int = DEFAULT_PORT) -> str:
    """The MLX_HOSTFILE content for the ring backend exactly as mlx.launch writes it (one
    connection per IP): an "ip:port" list per rank, ports counting up from `port` over every
    rank's every IP."""
    ports = iter(range(port, port + port_count(hosts)))
    return json.dumps([[f"{ip}:{next(ports)}" for ip in h.ips] for h in hosts.hosts])


def port_count(hosts: HostFile) -> int:
    """How many ring ports the group listens on (one per rank and IP)."""
    return sum(len(h.ips) for h in hosts.hosts)


def free_port_run(count: int) -> int:
    """A first port of `count` consecutive free TCP ports on loopback (tests, local groups)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count < 65535 and all(_free(base + i) for i in range(count)):
            return base
    raise RuntimeError(f"no run of {count} free ports found on loopback")


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _is_ip(text: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in text else socket.AF_INET, text)
    except OSError:
        return False
    return True
