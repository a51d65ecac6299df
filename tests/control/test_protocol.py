"""The control socket under bad input: the daemon answers or hangs up, and never dies."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mtplxd.control import protocol


def _exchange(path, payload: bytes, timeout: float = 10) -> list[dict]:
    """Send raw bytes, half-close, and read every answer line until the daemon closes."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return [json.loads(line) for line in data.splitlines() if line.strip()]


def test_status_reports_the_protocol_version(daemon):
    status = daemon.client.call("daemon.status")
    assert status["protocol"] == protocol.PROTOCOL_VERSION
    assert status["powered_by"] == "Powered by MTPLX"


def test_malformed_json_gets_a_parse_error_and_the_connection_stays_usable(daemon):
    ok = json.dumps({"jsonrpc": "2.0", "id": 7, "method": "daemon.status"}).encode()
    answers = _exchange(daemon.paths.socket, b"{not json\n" + ok + b"\n")
    assert answers[0]["error"]["code"] == protocol.PARSE_ERROR
    assert answers[1]["id"] == 7 and answers[1]["result"]["pid"] == daemon.pid


@pytest.mark.parametrize("message, code", [
    ({"jsonrpc": "1.0", "id": 1, "method": "daemon.status"}, protocol.INVALID_REQUEST),
    ({"jsonrpc": "2.0", "id": 1}, protocol.INVALID_REQUEST),
    ({"jsonrpc": "2.0", "id": [1], "method": "daemon.status"}, protocol.INVALID_REQUEST),
    ({"jsonrpc": "2.0", "id": 1, "method": "daemon.status", "params": [1]}, protocol.INVALID_PARAMS),
    ({"jsonrpc": "2.0", "id": 1, "method": "no.such"}, protocol.METHOD_NOT_FOUND),
    ({"jsonrpc": "2.0", "id": 1, "method": "logs.tail", "params": {"lines": "all"}}, protocol.INVALID_PARAMS),
    ({"jsonrpc": "2.0", "id": 1, "method": "config.set", "params": {"key": "port"}}, protocol.INVALID_PARAMS),
])
def test_invalid_requests_get_the_matching_json_rpc_error(daemon, message, code):
    [answer] = _exchange(daemon.paths.socket, json.dumps(message).encode() + b"\n")
    assert answer["error"]["code"] == code
    assert answer["error"]["data"]["reason"]


def test_notification_without_id_gets_no_answer(daemon):
    message = {"jsonrpc": "2.0", "method": "daemon.status"}
    assert _exchange(daemon.paths.socket, json.dumps(message).encode() + b"\n") == []


def test_oversized_message_is_refused_and_the_connection_closed(daemon):
    payload = b"x" * (protocol.MAX_MESSAGE_BYTES + 70000)
    answers = _exchange(daemon.paths.socket, payload)
    assert answers[-1]["error"]["data"]["reason"] == "message_too_large"
    assert daemon.client.is_running()


def test_abrupt_disconnect_mid_message_is_harmless(daemon):
    for _ in range(20):
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(str(daemon.paths.socket))
            sock.sendall(b'{"jsonrpc": "2.0", "id": 1, "meth')
    assert daemon.client.call("daemon.status")["pid"] == daemon.pid


def test_long_operations_stream_notifications_before_their_result(daemon):
    seen: list[tuple[str, dict]] = []
    from mtplxctl.client import ControlError

    with pytest.raises(ControlError) as failure:
        daemon.client.call("model.load", {"model": "/nonexistent/model"},
                           on_notification=lambda m, p: seen.append((m, p)))
    assert seen and seen[0][0] == "model.progress" and seen[0][1]["phase"] == "loading"
    assert failure.value.reason == "model_load_failed"
    assert "mtplxctl models pull" in failure.value.message


def test_config_set_and_get_round_trip_and_name_the_bad_key(daemon):
    assert daemon.client.call("config.set", {"key": "depth", "value": 2})["value"] == 2
    got = daemon.client.call("config.get", {"key": "depth"})
    assert got["settings"]["depth"] == {"value": 2, "source": "file"}
    from mtplxctl.client import ControlError

    with pytest.raises(ControlError) as failure:
        daemon.client.call("config.set", {"key": "port", "value": "eighty"})
    assert "'port'" in failure.value.message


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
method_names = st.sampled_from(["daemon.status", "daemon.methods", "config.get", "config.set",
                                "logs.tail", "model.unload", "nope", ""]) | st.text(max_size=12)


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(
    st.binary(max_size=300),
    st.builds(lambda m, p, i: json.dumps({"jsonrpc": "2.0", "id": i, "method": m, "params": p}).encode(),
              method_names, json_values, st.one_of(st.integers(), st.text(max_size=5), st.none())),
))
def test_fuzzed_input_never_kills_the_daemon(daemon, payload):
    # daemon.shutdown is the one method whose effect is to stop; the fuzzer never names it.
    if b"shutdown" in payload:
        return
    try:
        _exchange(daemon.paths.socket, payload + b"\n", timeout=10)
    except json.JSONDecodeError:
        pytest.fail("the daemon answered with something that is not JSON")
    assert daemon.process.poll() is None
    assert daemon.client.call("daemon.status")["pid"] == daemon.pid


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another uid")
def test_a_connection_from_another_uid_is_refused(daemon):
    """`nobody` cannot even reach the 0600 socket; with the mode opened up, the uid check refuses."""
    probe = (
        "import os, socket, sys\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "try:\n"
        "    s.connect(sys.argv[1])\n"
        "except PermissionError:\n"
        "    print('EACCES'); sys.exit(0)\n"
        "s.sendall(b'{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"daemon.status\"}\\n')\n"
        "print(s.recv(4096).decode())\n"
    )
    run_dir_mode = os.stat(daemon.paths.run_dir).st_mode
    blocked = subprocess.run([sys.executable, "-c", probe, str(daemon.paths.socket)],
                             capture_output=True, text=True, timeout=20)
    assert blocked.stdout.strip() == "EACCES", blocked.stderr
    os.chmod(daemon.paths.run_dir, 0o755)
    os.chmod(daemon.paths.socket, 0o666)
    parent = daemon.paths.home
    original_parents = []
    while parent != parent.parent:  # let nobody traverse down to the socket
        original_parents.append((parent, os.stat(parent).st_mode))
        os.chmod(parent, os.stat(parent).st_mode | 0o011)
        parent = parent.parent
    try:
        refused = subprocess.run([sys.executable, "-c", probe, str(daemon.paths.socket)],
                                 capture_output=True, text=True, timeout=20)
    finally:
        for path, mode in original_parents:
            os.chmod(path, mode)
        os.chmod(daemon.paths.run_dir, run_dir_mode)
    assert refused.stdout.strip(), refused.stderr
    answer = json.loads(refused.stdout)
    assert answer["error"]["data"]["reason"] == "permission_denied"
    assert "uid 65534" in answer["error"]["message"]
    assert daemon.client.is_running()
