"""How the daemon tells which service manager started it, and its READY=1 to systemd."""

from __future__ import annotations

import os
import secrets
import socket

from mtplxd.supervisor import LAUNCHD_LABEL, detect_supervisor, sd_notify


def test_markers_written_by_install_win():
    assert detect_supervisor({"MTPLX_SUPERVISOR": "launchd"}) == "launchd"
    assert detect_supervisor({"MTPLX_SUPERVISOR": "systemd"}) == "systemd"


def test_launchd_only_for_our_own_label():
    assert detect_supervisor({"XPC_SERVICE_NAME": LAUNCHD_LABEL}) == "launchd"
    # Terminal.app shells carry "0"; a shell inside an IDE inherits the IDE's label.
    assert detect_supervisor({"XPC_SERVICE_NAME": "0"}) is None
    assert detect_supervisor({"XPC_SERVICE_NAME": "application.com.microsoft.VSCode.123"}) is None


def test_systemd_by_exec_pid_or_notify_socket_not_by_inherited_invocation_id():
    assert detect_supervisor({"SYSTEMD_EXEC_PID": "4242"}, pid=4242) == "systemd"
    assert detect_supervisor({"NOTIFY_SOCKET": "/run/user/1000/systemd/notify"}) == "systemd"
    # A terminal that systemd runs passes these to everything started from it.
    assert detect_supervisor({"INVOCATION_ID": "ab" * 16, "SYSTEMD_EXEC_PID": "1"}, pid=4242) is None
    assert detect_supervisor({}) is None


def test_sd_notify_reaches_an_abstract_socket():
    name = f"mtplx-test-{secrets.token_hex(6)}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind("\0" + name)
        listener.settimeout(5)
        assert sd_notify("READY=1", {"NOTIFY_SOCKET": "@" + name})
        assert listener.recv(64) == b"READY=1"


def test_sd_notify_without_or_with_a_dead_socket_returns_false(tmp_path):
    assert sd_notify("READY=1", {}) is False
    # The socket of a manager that went away must never take the daemon down.
    assert sd_notify("STOPPING=1", {"NOTIFY_SOCKET": str(tmp_path / "gone.sock")}) is False
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as bound:
        path = tmp_path / "closed.sock"
        bound.bind(str(path))
    assert os.path.exists(path)
    assert sd_notify("STOPPING=1", {"NOTIFY_SOCKET": str(path)}) is False
