"""The uid of the process at the other end of a Unix stream socket.

Linux has SO_PEERCRED (struct ucred: pid, uid, gid). macOS has LOCAL_PEERCRED on SOL_LOCAL
(struct xucred: version, uid, ngroups, groups[16]); getpeereid(3) reads the same thing.
"""

from __future__ import annotations

import socket
import struct
import sys

import trio

_SOL_LOCAL = 0
_LOCAL_PEERCRED = 0x001
_XUCRED = struct.Struct("IIh")


def peer_uid(sock: socket.socket | trio.socket.SocketType) -> int:
    """Return the effective uid of the peer; raise OSError when the OS cannot say."""
    if hasattr(socket, "SO_PEERCRED"):
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", raw)
        return uid
    if sys.platform == "darwin":
        raw = sock.getsockopt(_SOL_LOCAL, _LOCAL_PEERCRED, 4 + 4 + 2 + 16 * 4 + 2)
        _version, uid, _ngroups = _XUCRED.unpack_from(raw)
        return uid
    raise OSError("peer credentials are not available on this platform")


def is_allowed(uid: int, own_uid: int) -> bool:
    """Only the daemon's own user and root may drive the daemon."""
    return uid == own_uid or uid == 0
