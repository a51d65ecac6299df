"""The first hour of a new user (issue #21): every start-up failure reads as one sentence that
says what to do, with a non-zero exit and no traceback."""

from __future__ import annotations

import os
import socket

from support.daemon import run_ctl


def test_port_in_use_names_the_holder_and_the_fix():
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        result = run_ctl("start", "--port", str(port))
    finally:
        holder.close()
    assert result.returncode != 0
    message = result.stderr
    assert f"port {port} is in use by PID {os.getpid()} (" in message, message
    assert f"--port {port + 1}" in message and "Traceback" not in message
    assert len([line for line in message.splitlines() if line.strip()]) <= 2


def test_an_unusable_mtplx_home_is_one_sentence_naming_the_path(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("MTPLX_HOME", str(blocker / "home"))
    for args in (["start"], ["config", "set", "depth", "2"]):
        result = run_ctl(*args)
        assert result.returncode == 1, (args, result.stderr)
        assert "Traceback" not in result.stderr, result.stderr
        assert str(blocker) in result.stderr and "MTPLX_HOME" in result.stderr, result.stderr
