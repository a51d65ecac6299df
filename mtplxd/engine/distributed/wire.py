"""The messages that travel on the ring, as `mx.distributed` sends and receives.

Every message starts with a fixed int32 header (HEADER_LEN values):
  [op, row, tokens, n_trims, trim_0..trim_3, n_frees, free_0..free_2]
- FORWARD: a hidden (1, tokens, H) follows; each worker first applies the row's pending
  trims (in order) and frees the rows named, runs its layers, passes header and hidden on.
  The last worker sends only the hidden back to rank 0, which knows what it asked.
- JSON: `row` holds the byte length of a UTF-8 JSON payload (uint8) that follows; each
  worker reads it, adds its answer, passes it on; the last one returns it to rank 0.
- STOP: workers pass it on and exit.
- PING: rank 0's heartbeat while it is idle; workers pass it on and the last returns it to
  rank 0. A worker that hears nothing from rank 0 for its deadline (rank 0 hung or stopped:
  its sockets stay open, so MLX's receive would wait for ever) exits.
Trims and frees ride on the next header instead of costing a message of their own.
Sends and receives run on the CPU stream, where the ring backend does its work (as mlx-lm's
own collectives at load do); on unified memory that copies nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

FORWARD, JSON, STOP, PING = 1, 2, 3, 4
MAX_TRIMS, MAX_FREES = 4, 3
HEADER_LEN = 5 + MAX_TRIMS + MAX_FREES
OPS = {FORWARD: "forward", JSON: "json", STOP: "stop", PING: "ping"}


@dataclass
class Header:
    """One decoded header (see the module docstring)."""

    op: int
    row: int = 0
    tokens: int = 0
    trims: list[int] = field(default_factory=list)
    frees: list[int] = field(default_factory=list)

    def encode(self) -> mx.array:
        """The int32 (HEADER_LEN,) array that goes on the wire."""
        if len(self.trims) > MAX_TRIMS or len(self.frees) > MAX_FREES:
            raise ValueError("too many trims or frees for one header")
        values = [self.op, self.row, self.tokens, len(self.trims)]
        values += self.trims + [0] * (MAX_TRIMS - len(self.trims))
        values += [len(self.frees)] + self.frees + [0] * (MAX_FREES - len(self.frees))
        return mx.array(values, dtype=mx.int32)

    @classmethod
    def decode(cls, array: mx.array) -> "Header":
        """The header an int32 (HEADER_LEN,) array carries."""
        v = array.tolist()
        n_trims = v[3]
        n_frees = v[4 + MAX_TRIMS]
        frees = v[5 + MAX_TRIMS:5 + MAX_TRIMS + n_frees]
        return cls(v[0], v[1], v[2], v[4:4 + n_trims], frees)


def send(array: mx.array, dst: int, group: mx.distributed.Group) -> None:
    """Send `array` to rank `dst` and wait until it has left."""
    mx.eval(mx.distributed.send(array, dst, group=group, stream=mx.cpu))


def recv(shape: tuple[int, ...], dtype: mx.Dtype, src: int,
         group: mx.distributed.Group) -> mx.array:
    """Receive an array of `shape` and `dtype` from rank `src` (blocks until it arrives)."""
    out = mx.distributed.recv(shape, dtype, src, group=group, stream=mx.cpu)
    mx.eval(out)
    return out


def send_all(arrays: list[mx.array], dst: int, group: mx.distributed.Group) -> None:
    """Send `arrays` to `dst` in order with one wait: each send depends on the one before, so
    the receiver reads them in this order (a header and its payload cost one sync, not two)."""
    sent = None
    for array in arrays:
        if sent is not None:
            array = mx.depends(array, sent)
        sent = mx.distributed.send(array, dst, group=group, stream=mx.cpu)
    mx.eval(sent)


def send_header(header: Header, dst: int, group: mx.distributed.Group) -> None:
    """Send one header to `dst`."""
    send(header.encode(), dst, group)


def recv_header(src: int, group: mx.distributed.Group) -> Header:
    """Receive one header from `src`."""
    return Header.decode(recv((HEADER_LEN,), mx.int32, src, group))


def send_json(obj: Any, dst: int, group: mx.distributed.Group) -> None:
    """Send a JSON header and its payload to `dst`."""
    payload = json.dumps(obj).encode()
    send_all([Header(JSON, row=len(payload)).encode(),
              mx.array(np.frombuffer(payload, dtype=np.uint8))], dst, group)


def recv_json_payload(length: int, src: int, group: mx.distributed.Group) -> Any:
    """Receive the payload of a JSON message whose header said `length` bytes."""
    data = recv((length,), mx.uint8, src, group)
    return json.loads(np.array(data).tobytes().decode())


def recv_json(src: int, group: mx.distributed.Group) -> Any:
    """Receive a whole JSON message (header and payload) from `src`."""
    header = recv_header(src, group)
    if header.op != JSON:
        raise RuntimeError(f"expected a JSON message, got {OPS.get(header.op, header.op)}")
    return recv_json_payload(header.row, src, group)
