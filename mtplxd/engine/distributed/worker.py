"""A worker rank: hold a slice of the trunk's layers and run it for rank 0, until told to stop.

In tensor mode (tensor.py) the slice is every layer, split across the ranks: each announced
forward runs in lockstep with rank 0's (their all_sums pair) and sends nothing back.

Started with MLX_RANK and MLX_HOSTFILE set (by mlx.launch or `launcher`), it joins the group,
reports what it would serve (fingerprint, memory), loads the slice rank 0's plan gives it,
then answers ring messages (wire.py) forever. Rows' caches live here, keyed by rank 0's row
ids. It exits when rank 0 says STOP, when the group breaks (a peer gone), or when nothing
came from rank 0 within its deadline (rank 0 hung or stopped; an idle rank 0 sends a
heartbeat well within it): it never waits for a dead or frozen daemon.

    python -m mtplxd.engine.distributed.worker --model PATH [--timeout SECONDS]
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
import time
from typing import Any

import mlx.core as mx

from mtplxd.engine.distributed import wire
from mtplxd.engine.distributed.fingerprint import fingerprint
from mtplxd.engine.distributed.link import DEFAULT_TIMEOUT_S
from mtplxd.engine.distributed.pipeline import GROUP_VISION_REASON, JOIN_TIMEOUT_S, LOAD_TIMEOUT_S
from mtplxd.engine.distributed.shard import (
    keep_only, parameter_groups, physical_memory, resident_bytes,
)
from mtplxd.engine.distributed.stage import run_layers
from mtplxd.engine.distributed.tensor import split_for_tensor
from mtplxd.engine.loaded_model import LoadedModel, load_model
from mtplxd.engine.model.families import get_family

log = logging.getLogger("mtplxd.worker")
EXIT_DEADLINE = 4  # nothing came from rank 0 in time


class Deadline:
    """Ends the process when a wait for rank 0 outlives its deadline.

    MLX's receive cannot time out and cannot be interrupted, so a watchdog thread checks the
    wait in progress and, past its deadline, logs why and exits the whole process."""

    def __init__(self, rank: int, poll: float = 0.1) -> None:
        self.rank, self.poll = rank, poll
        self._lock = threading.Lock()
        self._until: float | None = None
        self._what = ""
        threading.Thread(target=self._watch, name="mtplx-deadline", daemon=True).start()

    def waiting(self, seconds: float, what: str) -> None:
        """A wait for `what` starts now and may last `seconds`."""
        with self._lock:
            self._until, self._what = time.monotonic() + seconds, f"{what} within {seconds:g} s"

    def busy(self) -> None:
        """This rank computes (no deadline until the next wait)."""
        with self._lock:
            self._until = None

    def _watch(self) -> None:
        while True:
            time.sleep(self.poll)
            with self._lock:
                expired = self._until is not None and time.monotonic() > self._until
                what = self._what
            if expired:
                log.error("rank %d: no %s from rank 0 (hung, stopped or unreachable); exiting",
                          self.rank, what)
                logging.shutdown()
                os._exit(EXIT_DEADLINE)


class Worker:
    """One worker's state: group, loaded slice and the rows' caches."""

    def __init__(self, group: mx.distributed.Group, model_path: str, deadline: Deadline,
                 timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.group, self.model_path = group, model_path
        self.deadline, self.timeout = deadline, timeout
        self.rank, self.size = group.rank(), group.size()
        self.prev, self.next = self.rank - 1, (self.rank + 1) % self.size
        self.last = self.rank == self.size - 1
        self.loaded: LoadedModel | None = None
        self.start = self.end = 0
        self.tensor = False  # every layer, split across the ranks (tensor.py)
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
        self.tensor = plan.get("parallel") == "tensor"
        spec = get_family(plan["family"])
        began = time.perf_counter()
        shard = (split_for_tensor(spec, self.group, ends=False) if self.tensor
                 else keep_only(spec, self.start, self.end, ends=False))
        self.loaded = load_model(self.model_path, quantize=plan["quantize"], shard=shard,
                                 text_only=GROUP_VISION_REASON,
                                 dequantize_weights=plan.get("dequantize", "auto"))
        model, vision = self.loaded.model, self.loaded.vision
        # Every parameter this rank holds: its layers (or its part of every layer), no ends,
        # no vision tower.
        held = [model] + ([vision.model] if vision is not None else [])
        return {"rank": self.rank, "layers": [self.start, self.end], "dtype": self.loaded.info.dtype,
                "weights_bytes": resident_bytes(held), "holds": parameter_groups(model),
                "load_seconds": round(time.perf_counter() - began, 3)}

    def serve(self) -> None:
        """Answer ring messages until STOP (or the group breaks, which raises)."""
        text = self.loaded.trunk.text
        layers = text.model.layers[self.start:self.end]
        hidden_size = text.args.hidden_size
        dtype = getattr(mx, self.loaded.info.dtype)
        # Rank 0 may still be loading its own share when this rank has loaded.
        self.deadline.waiting(LOAD_TIMEOUT_S, "first message after loading")
        while True:
            header = wire.recv_header(self.prev, self.group)
            self.deadline.waiting(self.timeout, "message")
            if header.op in (wire.STOP, wire.PING):
                if not self.last or header.op == wire.PING:
                    wire.send_header(header, self.next, self.group)
                if header.op == wire.STOP:
                    return
                continue
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
            if self.tensor and not self.last:  # the announcement goes on before the all_sums
                wire.send_all([header.encode(), hidden], self.next, self.group)
            if self.tensor:  # the forward waits on rank 0 in every all_sum: keep the deadline
                self.deadline.waiting(self.timeout, "all_sum")
            else:
                self.deadline.busy()
            began = time.perf_counter()
            out = run_layers(layers, caches, hidden)
            mx.eval(out)
            self.compute_seconds += time.perf_counter() - began
            self.deadline.waiting(self.timeout, "message")
            self.forwards += 1
            if self.tensor:  # rank 0 holds the same output (the layers end in an all_sum)
                continue
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
    worker.deadline.waiting(JOIN_TIMEOUT_S, "hello")
    message = wire.recv_json(worker.prev, worker.group)
    message.setdefault("reports", []).append(worker.report())
    wire.send_json(message, worker.next, worker.group)
    worker.deadline.waiting(JOIN_TIMEOUT_S, "plan")
    plan = wire.recv_json(worker.prev, worker.group)
    if plan.get("refuse"):
        wire.send_json(plan, worker.next, worker.group)
        return False
    worker.deadline.busy()
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
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help="exit when nothing comes from rank 0 for this long while serving")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(message)s")
    deadline = Deadline(int(os.environ.get("MLX_RANK", "-1")))
    deadline.waiting(JOIN_TIMEOUT_S, "connection")
    group = mx.distributed.init(backend="ring", strict=True)
    worker = Worker(group, args.model, deadline, args.timeout)
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
