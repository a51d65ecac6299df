"""The control socket: a Unix stream server speaking newline-delimited JSON-RPC 2.0.

Every connection is checked against the peer's uid first; a stranger gets one error line and a
closed connection. Bad input (malformed JSON, unknown methods, oversized lines, a peer that
vanishes mid-request) costs that connection at most, never the daemon.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
from pathlib import Path

import trio

from mtplxd.control import protocol
from mtplxd.control.peercred import is_allowed, peer_uid
from mtplxd.control.protocol import Request, RpcError
from mtplxd.control.registry import MethodRegistry

log = logging.getLogger(__name__)

# Connections served at once: each holds a descriptor, and a client that opens many and sends
# nothing must not take the daemon's last ones (the HTTP API and the model need them too). One
# past it gets an error line and a closed connection. `mtplxctl` opens one per call.
MAX_CONNECTIONS = 128
# A connection that sends no request for this long is closed (a hung or stopped client keeps no
# slot for ever); a request being answered is never timed out.
IDLE_SECONDS = 120.0


async def bind_control_socket(path: Path) -> trio.socket.SocketType:
    """Bind and listen on `path` with mode 0600.

    The caller holds the single-instance lock, so a socket file already at `path` belongs to a
    dead daemon and is removed.
    """
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # The umask makes the socket 0600 from birth; the chmod below is belt and braces.
    old_umask = os.umask(0o177)
    try:
        await sock.bind(os.fspath(path))
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    sock.listen(64)
    return sock


async def serve_control(
    path: Path,
    registry: MethodRegistry,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept control connections until cancelled; removes the socket file on the way out."""
    listener = await bind_control_socket(path)
    own_uid = os.getuid()
    try:
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                try:
                    conn, _ = await listener.accept()
                except OSError as exc:
                    if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                        log.warning("control accept failed (%s); backing off", exc)
                        await trio.sleep(0.1)
                        continue
                    raise
                stream = trio.SocketStream(conn)
                # Each connection is one task of this nursery (a refusal's too, for its second).
                if len(nursery.child_tasks) >= MAX_CONNECTIONS:
                    nursery.start_soon(_refuse_busy, stream)
                else:
                    nursery.start_soon(_serve_connection, stream, registry, own_uid)
    finally:
        listener.close()
        try:
            path.unlink()
        except FileNotFoundError:
            pass


async def _refuse_busy(stream: trio.SocketStream) -> None:
    """One connection past MAX_CONNECTIONS: say why in one error line, then close."""
    async with stream:
        log.warning("control: %d connections open; refused one more", MAX_CONNECTIONS)
        error = RpcError(protocol.APP_ERROR, f"the daemon is serving {MAX_CONNECTIONS} control "
                         "connections already; try again when some have closed", "busy")
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError), trio.move_on_after(1):
            await stream.send_all(protocol.error_message(None, error))
            await _discard_input(stream)


async def _serve_connection(stream: trio.SocketStream, registry: MethodRegistry, own_uid: int) -> None:
    async with stream:
        try:
            uid = peer_uid(stream.socket)
        except OSError as exc:
            log.warning("control: cannot read peer credentials (%s); closing", exc)
            return
        try:
            if not is_allowed(uid, own_uid):
                log.warning("control: refused a connection from uid %d", uid)
                error = RpcError(protocol.APP_ERROR, f"uid {uid} may not control this daemon "
                                 f"(owned by uid {own_uid})", "permission_denied")
                await stream.send_all(protocol.error_message(None, error))
                # Closing while the peer's request is unread would reset the connection before
                # it reads why; read briefly what it sends, then close.
                await _discard_input(stream)
                return
            await _request_loop(stream, registry)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return  # the peer went away; nothing to answer
        except Exception as exc:  # noqa: BLE001 - whatever one connection raises ends it alone
            log.exception("control: connection failed; closing it")
            error = RpcError(protocol.INTERNAL_ERROR, f"internal error: {type(exc).__name__}",
                             "internal_error")
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await stream.send_all(protocol.error_message(None, error))


async def _request_loop(stream: trio.SocketStream, registry: MethodRegistry) -> None:
    buffer = bytearray()
    while True:
        newline = buffer.find(b"\n")
        # A line is too large whether or not its newline has arrived yet.
        if (newline if newline >= 0 else len(buffer)) > protocol.MAX_MESSAGE_BYTES:
            error = RpcError(protocol.INVALID_REQUEST,
                             f"message larger than {protocol.MAX_MESSAGE_BYTES} bytes",
                             "message_too_large")
            await stream.send_all(protocol.error_message(None, error))
            await _discard_input(stream)
            return
        if newline < 0:
            with trio.move_on_after(IDLE_SECONDS) as idle:
                chunk = await stream.receive_some(65536)
            if idle.cancelled_caught:
                log.info("control: closed a connection idle for %.0f s", IDLE_SECONDS)
                return
            if not chunk:
                # The peer closed its side: a last request without its newline is still one.
                if bytes(buffer).strip():
                    await _handle_line(stream, registry, bytes(buffer))
                return
            buffer += chunk
            continue
        line = bytes(buffer[:newline])
        del buffer[: newline + 1]
        if line.strip():
            await _handle_line(stream, registry, line)


async def _discard_input(stream: trio.SocketStream, seconds: float = 1.0) -> None:
    """Read and drop what the peer is still sending, briefly, so closing does not reset the
    connection before the peer has read our error."""
    with trio.move_on_after(seconds):
        while await stream.receive_some(65536):
            pass


async def _handle_line(stream: trio.SocketStream, registry: MethodRegistry, line: bytes) -> None:
    try:
        request = protocol.parse_request(line)
    except RpcError as error:
        await stream.send_all(protocol.error_message(error.request_id, error))
        return
    reply = await _dispatch(stream, registry, request)
    if not request.notification:
        await stream.send_all(reply)


async def _dispatch(stream: trio.SocketStream, registry: MethodRegistry, request: Request) -> bytes:
    method = registry.get(request.method)
    if method is None:
        error = RpcError(protocol.METHOD_NOT_FOUND, f"unknown method {request.method!r}",
                         "method_not_found", {"methods": registry.names()})
        return protocol.error_message(request.id, error)

    async def notify(name: str, params: dict) -> None:
        await stream.send_all(protocol.notification_message(name, params))

    try:
        result = await method.handler(request.params, notify)
    except RpcError as error:
        return protocol.error_message(request.id, error)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        raise
    except Exception as exc:  # a bug in one method must not take the daemon down
        log.exception("control method %s failed", request.method)
        error = RpcError(protocol.INTERNAL_ERROR, f"{request.method} failed: {exc}", "internal_error")
        return protocol.error_message(request.id, error)
    return protocol.result_message(request.id, result)
