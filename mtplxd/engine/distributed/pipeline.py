"""Rank 0's model over the group: a Trunk whose forward goes once around the ring.

`PipelineTrunk.body` runs the embedding step (Trunk's own) and rank 0's own first layers,
hands the hidden to the link (through every worker's slice and back), then applies the final
norm; Trunk.forward adds lm_head as it does for one process. Everything else of the engine (prefill chunks, the speculative cycle, sampling, the MTP
head, the scheduler) is unchanged: it sees one more cache entry per row, a `RemoteCache`
standing for every remote layer, whose `trim(n)` is carried to the workers on the row's next
forward. The verify of K+1 tokens is one forward, so it crosses the pipeline once per cycle.
`TensorTrunk` is the tensor parallel twin (tensor.py): rank 0 holds a part of every layer and
announces each forward, which the workers run in lockstep; `load_group_model` loads either.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from mtplxd.engine.distributed import wire
from mtplxd.engine.distributed.fingerprint import differences, fingerprint
from mtplxd.engine.distributed.link import Link
from mtplxd.engine.distributed.shard import (
    held_modules, keep_only, layer_count, parameter_groups, physical_memory, resident_bytes,
)
from mtplxd.engine.distributed.split import parse_split, split_layers
from mtplxd.engine.distributed.stage import run_layers
from mtplxd.engine.distributed.tensor import split_for_tensor, tensor_refusal
from mtplxd.engine.interface import GroupLost, ModelLoadError
from mtplxd.engine.loaded_model import LoadedModel, load_model
from mtplxd.engine.model.families import get_family
from mtplxd.engine.model.loader import inspect_checkpoint
from mtplxd.engine.model.trunk import Trunk

JOIN_TIMEOUT_S = 120.0  # every worker must have started and joined by then
LOAD_TIMEOUT_S = 900.0  # a worker reading its share of a large checkpoint
# A vision checkpoint is served text only over a group: an image row's positions live with its
# cache on rank 0, and the workers' layers would rotate it at 1-D positions, an answer no
# single-process run gives. So no rank loads the vision tower.
GROUP_VISION_REASON = ("images are not served over a distributed group: the workers' attention "
                       "layers cannot place image rows at their multimodal (mRoPE) positions; "
                       "serving text only")


class RemoteCache:
    """The trunk-cache entry of one row for every layer the workers hold."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.row = link.new_row()
        self.pending: list[int] = []  # trims not yet carried to the workers
        self.offset = 0

    def is_trimmable(self) -> bool:
        """Always: every worker cache is trimmable (the engine's caches are)."""
        return True

    def trim(self, n: int) -> int:
        """Drop the last n tokens on every worker (with the row's next message)."""
        if n:
            self.pending.append(n)
            self.offset -= n
        return n

    def take_trims(self) -> list[int]:
        """The pending trims, in order, now leaving for the workers."""
        trims, self.pending = self.pending, []
        return trims

    def __del__(self) -> None:
        self.link.release(self.row)


class PipelineTrunk(Trunk):
    """A Trunk whose layers from `local_end` on live on the workers (see the module doc)."""

    def __init__(self, model: Any, spec: Any, link: Link, local_end: int) -> None:
        super().__init__(model, spec)
        self.link = link
        self.local_end = local_end
        # The fused loop compiles a whole cycle into one graph; a ring exchange cannot be part
        # of it (fused_supported also says no: a RemoteCache is not a KVCache).
        self.decode_loop = "stepwise"

    def make_cache(self) -> list[Any]:
        """Rank 0's own layers' caches, then one RemoteCache for the rest."""
        return super().make_cache()[:self.local_end] + [RemoteCache(self.link)]

    def body(self, tokens: mx.array, cache: list[Any],
             embeddings: mx.array | None = None) -> mx.array:
        """As Trunk.body (post-norm hidden (1, L, H)), the layers from `local_end` on around
        the ring; Trunk.forward adds lm_head as for one process."""
        body = self.text.model
        hidden = self.input_hidden(tokens, embeddings)
        hidden = run_layers(body.layers[:self.local_end], cache[:-1], hidden)
        remote: RemoteCache = cache[-1]
        hidden = self.link.forward(remote.row, remote.take_trims(), hidden)
        remote.offset += tokens.shape[1]
        return body.norm(hidden)


class TensorTrunk(PipelineTrunk):
    """Tensor parallel (tensor.py): rank 0 holds a part of every layer; each forward is
    announced to the workers and runs in lockstep with theirs. The RemoteCache carries the
    row's trims (and frees) to the workers' caches as in pipeline mode."""

    def __init__(self, model: Any, spec: Any, link: Link) -> None:
        super().__init__(model, spec, link, len(spec.text_model(model).model.layers))

    def body(self, tokens: mx.array, cache: list[Any],
             embeddings: mx.array | None = None) -> mx.array:
        """As Trunk.body; the sharded layers run on the link thread, under its deadline."""
        body = self.text.model
        layers, caches, remote = body.layers, cache[:-1], cache[-1]
        # MLX evaluates an array only on the thread whose stream built it. The layers run on
        # the link thread, while the engine trims the hybrid's Gated DeltaNet caches on this
        # one (a trim builds the committed state lazily: rollback.py); so each thread
        # evaluates what it built: the trims here, the forward's cache updates there.
        mx.eval(recurrent_state(caches))

        def compute(hidden: mx.array) -> mx.array:
            out = run_layers(layers, caches, hidden)
            mx.eval(out, recurrent_state(caches))
            return out
        hidden = self.link.forward_together(
            remote.row, remote.take_trims(), self.input_hidden(tokens, embeddings), compute)
        remote.offset += tokens.shape[1]
        return body.norm(hidden)


def recurrent_state(caches: list[Any]) -> list[mx.array]:
    """The arrays the recurrent (Gated DeltaNet) entries of `caches` hold; attention KV
    caches hold none that a trim builds."""
    return [a for c in caches if isinstance(c, ArraysCache) for a in c.cache if a is not None]


@dataclass
class GroupInfo:
    """What status shows of a serving group."""

    ranks: list[dict[str, Any]] = field(default_factory=list)
    split: list[list[int]] = field(default_factory=list)
    link: dict[str, Any] = field(default_factory=dict)
    parallel: str = "pipeline"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        return {"parallel": self.parallel, "ranks": self.ranks, "split": self.split,
                "link": self.link}


def join_group(ring_hostfile: str, link: Link, timeout: float = JOIN_TIMEOUT_S) -> None:
    """Join as rank 0: MLX reads its rank and the ring's addresses from the environment."""
    handle = tempfile.NamedTemporaryFile("w", suffix=".json", prefix="mtplx-ring-", delete=False)
    with handle:
        handle.write(ring_hostfile)
    os.environ["MLX_RANK"] = "0"
    os.environ["MLX_HOSTFILE"] = handle.name
    try:
        link.join(timeout)
    finally:
        # Gone once joined: no process the daemon starts later may think it is rank 0.
        del os.environ["MLX_RANK"], os.environ["MLX_HOSTFILE"]
        os.unlink(handle.name)


def load_group_model(path: str | os.PathLike, link: Link, *, split: str | None = None,
                     model_id: str | None = None, depth: int | None = None,
                     quantize: str = "auto", dequantize: str = "auto", parallel: str = "pipeline",
                     log: Callable[[str], None] = lambda line: None) -> LoadedModel:
    """Check every rank serves the same model, split it (`parallel`: "pipeline" splits the
    layers, "tensor" every layer: tensor.py), load rank 0's share, and return a LoadedModel
    whose trunk runs over the group. ModelLoadError names any refusal (a rank with another
    revision or config, a family that cannot be split, a bad split)."""
    path = Path(path).expanduser().resolve()
    # Workers first report (and then wait for the plan or a refusal), whatever rank 0 decides.
    reports = link.ring_json({"kind": "hello"}, JOIN_TIMEOUT_S)["reports"]
    report = inspect_checkpoint(path)
    spec = get_family(report.model_type)
    if report.mode == "refused" or spec is None:
        reason = report.reason if report.mode == "refused" else (
            f"{report.model_type} has no registered family; pipeline serving covers "
            "qwen3, qwen3_5, qwen3_5_moe and qwen3_next")
        _refuse(link, reason)
    own = fingerprint(path)
    for peer in reports:
        diffs = differences(own, peer["fingerprint"])
        if diffs:
            _refuse(link, f"rank {peer['rank']} ({peer['host']}) does not serve the same model as "
                          f"rank 0: {'; '.join(diffs[:5])}")
    num_layers = layer_count(own["config"])
    if parallel == "tensor":
        reason = tensor_refusal(report.model_type, own["config"], link.size)
        if reason:
            _refuse(link, reason)
        slices = [(0, num_layers)] * link.size
        log(f"tensor parallel: every layer split across {link.size} ranks")
    else:
        slices = _pipeline_slices(link, split, num_layers, reports)
        log("layer split: " + ", ".join(f"rank {r}: {s}-{e - 1}" for r, (s, e) in enumerate(slices)))
    plan = {"kind": "plan", "slices": slices, "family": report.model_type, "quantize": quantize,
            "dequantize": dequantize, "parallel": parallel}
    # Workers load while rank 0 does: the plan goes out, rank 0 loads, then collects the acks.
    group, last = link.group, link.size - 1
    link.call(lambda: wire.send_json(plan, 1, group))
    began = time.perf_counter()
    shard = (split_for_tensor(spec, group, ends=True) if parallel == "tensor"
             else keep_only(spec, 0, slices[0][1], ends=True))
    loaded = load_model(path, model_id=model_id, depth=depth, quantize=quantize, shard=shard,
                        text_only=GROUP_VISION_REASON, dequantize_weights=dequantize)
    if parallel == "tensor":
        # Rank 0's layers run on the link thread, and MLX evaluates an array only on the thread
        # whose stream built it: evaluate the weights here, where the load (a bfloat16
        # checkpoint's lazy upcast to float32 on the CPU backend included) built them.
        mx.eval(loaded.model.parameters())
    own_seconds = time.perf_counter() - began
    acks = link.call(lambda: wire.recv_json(last, group), LOAD_TIMEOUT_S)
    if acks.get("errors"):
        raise ModelLoadError("; ".join(acks["errors"]))
    for ack in acks["loaded"]:
        if ack["dtype"] != loaded.info.dtype:
            raise ModelLoadError(f"rank {ack['rank']} computes in {ack['dtype']}, rank 0 in "
                                 f"{loaded.info.dtype}: use the same backend on every host")
    text = spec.text_model(loaded.model)
    link.hidden_size, link.dtype = text.args.hidden_size, getattr(mx, loaded.info.dtype)
    trunk = (TensorTrunk(loaded.model, spec, link) if parallel == "tensor"
             else PipelineTrunk(loaded.model, spec, link, slices[0][1]))
    loaded.trunk = trunk
    own_bytes = resident_bytes(held_modules(spec, loaded.model, 0, slices[0][1], ends=True))
    # The guard prices what rank 0 holds (its weights; KV priced for every layer: conservative).
    loaded.info = replace(loaded.info, decode_loop="stepwise", weights_bytes=own_bytes)
    by_rank = {p["rank"]: p for p in reports}
    ranks = [{"rank": 0, "host": os.uname().nodename, "layers": list(slices[0]),
              "weights_bytes": own_bytes, "holds": parameter_groups(loaded.model),
              "memory_bytes": physical_memory(), "load_seconds": round(own_seconds, 3)}]
    for ack in acks["loaded"]:
        peer = by_rank[ack["rank"]]
        ranks.append({"rank": ack["rank"], "host": peer["host"], "pid": peer["pid"],
                      "layers": ack["layers"], "weights_bytes": ack["weights_bytes"],
                      "holds": ack["holds"],
                      "memory_bytes": peer["memory_bytes"], "load_seconds": ack["load_seconds"]})
    loaded.group = GroupInfo(ranks, [list(s) for s in slices], measure_link(link), parallel)
    link.start_heartbeat()  # from now on workers expect word from rank 0 within the deadline
    return loaded


def _pipeline_slices(link: Link, split: str | None, num_layers: int,
                     reports: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """Each rank's layers: the `split` asked for, else in proportion to memory (refused,
    telling the workers, when it does not fit the group)."""
    try:
        slices = (parse_split(split, num_layers) if split else
                  split_layers(num_layers, [physical_memory()] + [p["memory_bytes"] for p in reports]))
        if len(slices) != link.size:
            raise ValueError(f"split {split!r} has {len(slices)} parts for {link.size} ranks")
    except ValueError as exc:
        _refuse(link, str(exc))
    return slices


def measure_link(link: Link, rounds: int = 5) -> dict[str, Any]:
    """Ring round trips at start: a small message (latency) and 1 MiB (bandwidth), medians."""
    def timed(message: dict[str, Any]) -> float:
        times = []
        for _ in range(rounds):
            began = time.perf_counter()
            link.ring_json(message)
            times.append(time.perf_counter() - began)
        return sorted(times)[len(times) // 2]
    size = 8 << 20
    small = timed({"kind": "ping"})
    big = timed({"kind": "ping", "pad": "x" * size})
    hops = link.size
    # Each hop also decodes and re-encodes the JSON: a floor on the link's real bandwidth.
    bandwidth = size / ((big - small) / hops) / 1e6 if big > small else None
    return {"ring_round_trip_ms": round(small * 1e3, 3), "hop_latency_ms": round(small * 1e3 / hops, 3),
            "hop_bandwidth_mb_s": round(bandwidth, 1) if bandwidth else None}


def worker_stats(link: Link) -> list[dict[str, Any]]:
    """Each worker's counters (compute seconds, forwards, rows, memory)."""
    return link.ring_json({"kind": "stats"})["ranks"]


def _refuse(link: Link, reason: str) -> None:
    """Tell the workers the group is refused (they exit), then raise ModelLoadError."""
    try:
        link.ring_json({"kind": "plan", "refuse": reason}, 10.0)
    except GroupLost:
        pass
    raise ModelLoadError(reason)
