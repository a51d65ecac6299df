"""A serving group as the daemon holds it: workers, the link, the model over them, status.

One group per daemon process: MLX joins a group once per process, so the group serves the
model it was started with until the daemon stops; loading another model, or serving again
after the group lost a rank, needs `mtplxctl restart`. Everything here runs on the owner
thread (MLX) except `status`, which only reads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from mtplxd.engine.distributed.hostfile import (
    DEFAULT_PORT, HostFile, free_port_run, port_count, read_hosts,
)
from mtplxd.engine.distributed.launcher import Workers
from mtplxd.engine.distributed.link import DEFAULT_TIMEOUT_S, Link
from mtplxd.engine.distributed.pipeline import join_group, load_group_model
from mtplxd.engine.interface import ModelLoadError


@dataclass(frozen=True)
class GroupOptions:
    """The daemon's group settings (config keys hosts, pipeline_split, group_timeout_seconds)."""

    hosts_file: Path
    log_dir: Path
    split: str | None = None
    timeout: float = DEFAULT_TIMEOUT_S
    port: int = DEFAULT_PORT  # the ring's first port; 0 finds free ones (every rank local)


class ServingGroup:
    """Start the workers and serve one model over them (see the module docstring)."""

    def __init__(self, options: GroupOptions, log: Callable[[str], None] = lambda line: None) -> None:
        self.options = options
        self.log = log
        self.hosts: HostFile | None = None  # read at load: a bad file is that load's error
        self.workers: Workers | None = None
        self.link: Link | None = None
        self.model: Any = None
        self.served: Path | None = None
        self.started_at: float | None = None

    def load(self, path: Path, *, model_id: str, depth: int | None, quantize: str,
             dequantize: str = "auto") -> Any:
        """The LoadedModel of `path` over the group (owner thread); ModelLoadError when it
        cannot be (a refused rank, a worker that never joined, another model than the one
        this group was started with)."""
        if self.link is not None:
            if self.served == path and self.model is not None and self.link.lost is None:
                return self.model
            held = f"lost a rank ({self.link.lost})" if self.link.lost else f"serves {self.served}"
            raise ModelLoadError(f"this daemon's distributed group {held}; MLX joins one group "
                                 "per process, so serve another model (or this one again) "
                                 "after `mtplxctl restart`")
        try:
            self.hosts = read_hosts(self.options.hosts_file)
        except ValueError as exc:
            raise ModelLoadError(f"host file {self.options.hosts_file}: {exc}") from None
        port = self.options.port or free_port_run(port_count(self.hosts))
        self.workers = Workers(self.hosts, str(path), port, self.options.log_dir,
                               timeout=self.options.timeout)
        self.link = Link(self.options.timeout, on_lost=self.workers.on_lost,
                         ended=self.workers.describe_exits)
        self.served = path
        self.workers.start()
        try:
            join_group(self.workers.ring, self.link)
            self.model = load_group_model(path, self.link, split=self.options.split,
                                          model_id=model_id, depth=depth, quantize=quantize,
                                          dequantize=dequantize,
                                          parallel=self.hosts.parallel, log=self.log)
        except Exception as exc:
            self.stop()
            if isinstance(exc, ModelLoadError):
                raise
            raise ModelLoadError(f"the distributed group did not start: {exc}; worker logs are "
                                 f"in {self.options.log_dir}") from exc
        self.started_at = time.time()
        return self.model

    def status(self) -> dict[str, Any]:
        """Every rank (host, layers, memory, running), the split, link speed, lost reason."""
        out: dict[str, Any] = {"hosts_file": str(self.options.hosts_file),
                               "size": self.hosts.size if self.hosts is not None else None,
                               "lost": self.link.lost if self.link is not None else None}
        group = getattr(self.model, "group", None)
        if group is not None:
            out.update(group.to_dict())
        if self.workers is not None:
            states = {s["rank"]: s for s in self.workers.states()}
            for rank in out.get("ranks", []):
                rank.update({k: v for k, v in states.get(rank["rank"], {}).items()
                             if k in ("running", "exit_code", "log")})
        if self.link is not None:
            out["exchanges"] = self.link.exchanges
            out["exchange_seconds"] = round(self.link.exchange_seconds, 6)
        return out

    def stop(self) -> None:
        """Tell the workers to exit, then make sure they have (owner thread)."""
        if self.link is not None:
            self.link.stop()
        if self.workers is not None:
            self.workers.stop()
