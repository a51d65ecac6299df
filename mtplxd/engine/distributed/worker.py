"""A worker rank: hold a slice of the trunk's layers and run it for rank 0, until told to stop.

Started with MLX_RANK and MLX_HOSTFILE set (by mlx.launch or `launcher`), it joins the group,
reports what it would serve (fingerprint, memory), loads the slice rank 0's plan gives it,
then answers ring messages (wire.py) forever. Rows' caches live here, keyed by rank 0's row
ids. It exits when rank 0 says STOP or when the group breaks (a peer gone): it never waits
for a dead daemon.

    python -m mtplxd.engine.distributed.worker --model PATH
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time
from typing import Any

import mlx.core as mx

from mtplxd.engine.distributed import wire
from mtplxd.engine.distributed.fingerprint import fingerprint
from mtplxd.engine.distributed.shard import held_modules, keep_only, physical_memory, resident_bytes
from mtplxd.engine.distributed.stage import run_layers
from mtplxd.engine.loaded_model import LoadedModel, load_model
from mtplxd.engine.model.families import get_family

log = logging.getLogger("mtplxd.worker")


class Worker:
    """One worker's state: group, loaded slice and the rows' caches."""

    def __init__(self, group: mx.distributed.Group, model_path: str) -> None:
        self.group, self.model_path = group, model_path
        self.rank, self.size = group.rank(), group.size()
        self.prev, self.next = self.rank - 1, (self.rank + 1) % self.size
        self.last = self.rank == self.size - 1
        self.loaded: LoadedModel | None = None
        self.start = self.end = 0
        self.rows: dict[int, list[Any]] = {}
        self.compute_seconds = 0.0
        self.forwards = 0

    def report(self) -> dict[str, Any]:
        """What rank 0 needs to plan and check this rank."""
        return {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(),
                "memory_bytes": physical_memory(), "fingerprint": fingerprint(self.model_path)}

    def load(self, plan: dict[str, Any]) -> dict[str, Any]:
        """Load this rank's slice of the plan; what rank 0 shows in status."""
        self.start, self.end = plan["slices"][self.rank]
        spec = get_family(plan["family"])
        began = time.perf_counter()
        self.loaded = load_model(self.model_path, quantize=plan["quantize"],
                                 shard=keep_only(spec, self.start, self.end, ends=False))
        held = held_modules(spec, self.loaded.model, self.start, self.end, ends=False)
        return {"rank": self.rank, "layers": [self.start, self.end], "dtype": self.loaded.info.dtype,
                "weights_bytes": resident_bytes(held),
                "load_seconds": round(time.perf_counter() - began, 3)}

    def serve(self) -> None:
        """Answer ring messages until STOP (or the group breaks, which raises)."""
        text = self.loaded.trunk.text
        layers = text.model.layers[self.start:self.end]
        hidden_size = text.args.hidden_size
        dtype = getattr(mx, self.loaded.info.dtype)
        while True:
            header = wire.recv_header(self.prev, self.group)
            if header.op == wire.STOP:
                if not self.last:
                    wire.send_header(header, self.next, self.group)
                return
            if header.op == wire.JSON:
                message = wire.recv_json_payload(header.row, self.prev, self.group)
                wire.send_json(self.answer(message), self.next, self.group)
                continue
            for row in header.frees:
                self.rows.pop(row, None)
            caches = self.rows.get(header.row)
            if caches is None and header.tokens:
                caches = self.rows[header.row] = self.loaded.trunk.make_cache()[self.start:self.end]
            for n in header.trims if caches is not None else ():
                for cache in caches:
                    cache.trim(n)
            if not header.tokens:  # trims and frees only
                if not self.last:
                    wire.send_header(header, self.next, self.group)
                continue
            hidden = wire.recv((1, header.tokens, hidden_size), dtype, self.prev, self.group)
            began = time.perf_counter()
            out = run_layers(layers, caches, hidden)
            mx.eval(out)
            self.compute_seconds += time.perf_counter() - began
            self.forwards += 1
            if self.last:
                wire.send(out, self.next, self.group)
            else:
                wire.send_all([header.encode(), out], self.next, self.group)

    def answer(self, message: dict[str, Any]) -> dict[str, Any]:
        """Add this rank's part to a JSON message going around the ring."""
        kind = message.get("kind")
        if kind == "stats":
            message.setdefault("ranks", []).append({
                "rank": self.rank, "rows": len(self.rows), "forwards": self.forwards,
                "compute_seconds": round(self.compute_seconds, 6),
                "active_memory_bytes": mx.get_active_memory()})
        elif kind == "reset_stats":
            self.compute_seconds, self.forwards = 0.0, 0
        return message


def handshake(worker: Worker) -> bool:
    """Report, then take the plan and load; False when rank 0 refused the group."""
    message = wire.recv_json(worker.prev, worker.group)
    message.setdefault("reports", []).append(worker.report())
    wire.send_json(message, worker.next, worker.group)
    plan = wire.recv_json(worker.prev, worker.group)
    if plan.get("refuse"):
        wire.send_json(plan, worker.next, worker.group)
        return False
    try:
        plan.setdefault("loaded", []).append(worker.load(plan))
    except Exception as exc:  # rank 0 names it; this rank then exits
        plan.setdefault("errors", []).append(f"rank {worker.rank}: {exc}")
    wire.send_json(plan, worker.next, worker.group)
    return worker.loaded is not None


def main(argv: list[str] | None = None) -> int:
    """Join the group, load, serve; the exit status says how it ended."""
    parser = argparse.ArgumentParser(prog="mtplxd-worker", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="the model folder on this host")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(message)s")
    group = mx.distributed.init(backend="ring", strict=True)
    worker = Worker(group, args.model)
    try:
        if not handshake(worker):
            log.info("rank %d: refused by rank 0", worker.rank)
            return 2
        log.info("rank %d: serving layers %d-%d", worker.rank, worker.start, worker.end - 1)
        worker.serve()
    except RuntimeError as exc:  # the ring broke: rank 0 or a neighbour is gone
        log.info("rank %d: group lost (%s); exiting", worker.rank, exc)
        return 3
    log.info("rank %d: stopped", worker.rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
