"""The control socket under bad input: the daemon answers or hangs up, and never dies."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mtplxd.control import protocol

# 0: each fuzz test's CI-sized default; MTPLX_FUZZ_EXAMPLES=10000 runs the long campaign
# (docs/reliability.md).
EXAMPLES = int(os.environ.get("MTPLX_FUZZ_EXAMPLES", "0"))


def examples(default: int) -> int:
    return EXAMPLES or default


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


def test_request_with_a_null_id_is_answered_with_a_null_id(daemon):
    message = {"jsonrpc": "2.0", "id": None, "method": "daemon.status"}
    [answer] = _exchange(daemon.paths.socket, json.dumps(message).encode() + b"\n")
    assert answer["id"] is None and answer["result"]["pid"] == daemon.pid


@pytest.mark.parametrize("line", [
    b"9" * 5000,  # an integer literal past Python's 4,300-digit limit: ValueError
    b"[" * 5000 + b"]" * 5000,  # nested deeper than the parser's stack: RecursionError
    b'{"jsonrpc":"2.0","id":1,"method":"daemon.status","params":{"x":' + b"[" * 3000 + b"]" * 3000 + b"}}",
    b'{"jsonrpc":"2.0","id":1,"method":"logs.tail","params":{"lines":' + b"7" * 4400 + b"}}",
], ids=["huge-integer", "deep-array", "deep-params", "huge-integer-param"])
def test_a_line_the_json_parser_chokes_on_is_a_parse_error_not_a_dead_daemon(daemon, line):
    ok = json.dumps({"jsonrpc": "2.0", "id": 2, "method": "daemon.status"}).encode()
    answers = _exchange(daemon.paths.socket, line + b"\n" + ok + b"\n")
    assert answers[0]["error"]["code"] == protocol.PARSE_ERROR
    assert answers[1]["id"] == 2, "the connection stays usable after a parse error"
    assert daemon.process.poll() is None
    assert daemon.client.call("daemon.status")["pid"] == daemon.pid


def test_oversized_message_is_refused_and_the_connection_closed(daemon):
    payload = b"x" * (protocol.MAX_MESSAGE_BYTES + 70000)
    answers = _exchange(daemon.paths.socket, payload)
    assert answers[-1]["error"]["data"]["reason"] == "message_too_large"
    assert daemon.client.is_running()


@pytest.mark.parametrize("excess", [1, 78, 65536])
def test_a_complete_line_just_over_the_limit_is_refused_too(daemon, excess):
    # The line and its newline arrive together: the size is checked on the line, not only on
    # a buffer still waiting for its newline.
    status = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "daemon.status", "params": {"pad": ""}}, separators=(",", ":"))
    padding = protocol.MAX_MESSAGE_BYTES + excess - len(status)
    line = status.replace('"pad":""', '"pad":"' + "x" * padding + '"').encode()
    assert len(line) == protocol.MAX_MESSAGE_BYTES + excess
    answers = _exchange(daemon.paths.socket, line + b"\n")
    assert [a["error"]["data"]["reason"] for a in answers] == ["message_too_large"]
    assert daemon.client.is_running()


def test_a_line_exactly_at_the_limit_is_served(daemon):
    status = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "daemon.status", "params": {"pad": ""}}, separators=(",", ":"))
    line = status.replace('"pad":""', '"pad":"' + "x" * (protocol.MAX_MESSAGE_BYTES - len(status)) + '"')
    [answer] = _exchange(daemon.paths.socket, line.encode() + b"\n")
    assert answer["result"]["pid"] == daemon.pid


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
    # A path names a folder on this machine: nothing to pull (a repo id's message says to).
    assert failure.value.message.startswith("no such folder: /nonexistent/model")
    assert "models pull" not in failure.value.message


def test_config_set_and_get_round_trip_and_name_the_bad_key(daemon):
    assert daemon.client.call("config.set", {"key": "depth", "value": 2})["value"] == 2
    got = daemon.client.call("config.get", {"key": "depth"})
    assert got["settings"]["depth"] == {"value": 2, "source": "file"}
    from mtplxctl.client import ControlError

    with pytest.raises(ControlError) as failure:
        daemon.client.call("config.set", {"key": "port", "value": "eighty"})
    assert failure.value.message == 'port cannot be "eighty": it must be a whole number from 0 to 65535'



def test_config_get_over_a_config_file_broken_since_the_start_says_so(daemon):
    """The user breaks config.toml while the daemon runs: `config.get` answers `invalid_config`
    naming the file's fault, not an internal error, and the daemon serves on."""
    from mtplxctl.client import ControlError

    daemon.paths.config_file.write_text("depth = [unclosed\n")
    with pytest.raises(ControlError) as failure:
        daemon.client.call("config.get", {"key": "depth"})
    assert failure.value.reason == "invalid_config" and "config.toml" in failure.value.message
    assert daemon.client.call("daemon.status")["pid"] == daemon.pid

def test_a_load_setting_set_over_the_socket_applies_at_the_next_model_load(daemon):
    """`config set kv_bits 8` answers next_load, and the next model.load serves it: the load
    reads config.toml as it is then, not as it was when the daemon started."""
    from mtplxctl.client import ControlError

    daemon.client.call("model.load", {}, timeout=120)
    assert daemon.client.call("daemon.status")["model"]["kv_bits"] == 0
    assert daemon.client.call("config.set", {"key": "kv_bits", "value": 8})["applies"] == "next_load"
    daemon.client.call("model.load", {}, timeout=120)
    assert daemon.client.call("daemon.status")["model"]["kv_bits"] == 8
    # A config.toml broken by hand: the load is refused in words, the model and daemon stay.
    daemon.paths.config_file.write_text("kv_bits = [\n")
    with pytest.raises(ControlError) as failure:
        daemon.client.call("model.load", {}, timeout=120)
    assert failure.value.reason == "invalid_config"
    assert daemon.client.call("daemon.status")["model"]["state"] == "loaded"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
method_names = st.sampled_from(["daemon.status", "daemon.methods", "config.get", "config.set",
                                "logs.tail", "model.unload", "nope", ""]) | st.text(max_size=12)


@settings(max_examples=examples(120), deadline=None, suppress_health_check=list(HealthCheck))
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


# Every method but daemon.shutdown, with the parameters it reads. Their values are never
# strings, so no fuzzed call can name a model to load or pull (no network, no slow load), and
# never null where null would mean "the configured model".
METHOD_PARAMS = {
    "daemon.status": [], "daemon.methods": [], "model.unload": [],
    "model.load": ["model", "depth"], "config.get": ["key"], "config.set": ["key", "value"],
    "logs.tail": ["lines"], "models.list": [], "models.catalog": [], "models.check": ["model"],
    "models.pull": ["model"], "models.update": ["model"], "models.rm": ["model"],
    "fans.status": [], "fans.set": ["mode"],
}
wrong_values = st.recursive(
    st.booleans() | st.integers() | st.floats() | st.just(10 ** 4000),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children,
                                                                       max_size=3),
    max_leaves=6,
)


def test_the_fuzzed_method_table_names_every_method(daemon):
    served = set(daemon.client.call("daemon.methods")["methods"])
    assert served == set(METHOD_PARAMS) | {"daemon.shutdown"}


@st.composite
def wrongly_typed_calls(draw):
    method = draw(st.sampled_from(sorted(METHOD_PARAMS)))
    params = {key: draw(wrong_values) for key in METHOD_PARAMS[method]}
    params.update(draw(st.dictionaries(st.text(max_size=6), wrong_values, max_size=2)))
    params = {k: v for k, v in params.items() if k not in {"model", "key", "mode"} or v is not None}
    return method, params


@settings(max_examples=examples(150), deadline=None, suppress_health_check=list(HealthCheck))
@given(wrongly_typed_calls())
def test_wrongly_typed_params_of_every_method_get_an_answer_never_a_dead_daemon(daemon, call):
    method, params = call
    # Integers past the JSON parser's digit limit are written by hand: json.dumps writes them.
    line = json.dumps({"jsonrpc": "2.0", "id": 9, "method": method, "params": params}).encode()
    answers = _exchange(daemon.paths.socket, line + b"\n")
    assert len(answers) == 1 and answers[0]["id"] in (9, None)
    if "error" in answers[0]:
        assert answers[0]["error"]["code"] != protocol.INTERNAL_ERROR, answers[0]
    assert daemon.process.poll() is None


@settings(max_examples=examples(100), deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(
    st.binary(min_size=1, max_size=400),
    st.builds(lambda depth: b"[" * depth + b"]" * depth, st.integers(500, 50_000)),
    st.builds(lambda depth: b'{"a":' * depth + b"1" + b"}" * depth, st.integers(500, 20_000)),
    st.builds(lambda digits: b'{"jsonrpc":"2.0","id":' + b"1" * digits + b',"method":"daemon.status"}',
              st.integers(4301, 20_000)),
))
def test_arbitrary_bytes_deep_nesting_and_huge_numbers_each_get_an_error_line(daemon, payload):
    if b"\n" in payload:
        payload = payload.replace(b"\n", b" ")
    if not payload.strip():
        return
    answers = _exchange(daemon.paths.socket, payload + b"\n")
    assert len(answers) == 1 and "error" in answers[0]
    assert daemon.process.poll() is None


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


def test_a_last_request_without_its_newline_is_answered_when_the_peer_half_closes(daemon):
    message = {"jsonrpc": "2.0", "id": 9, "method": "daemon.status"}
    [answer] = _exchange(daemon.paths.socket, json.dumps(message).encode())
    assert answer["id"] == 9 and answer["result"]["pid"] == daemon.pid


def test_an_error_about_the_params_answers_the_requests_own_id(daemon):
    message = {"jsonrpc": "2.0", "id": 7, "method": "daemon.status", "params": [1]}
    [answer] = _exchange(daemon.paths.socket, json.dumps(message).encode() + b"\n")
    assert answer["id"] == 7 and answer["error"]["code"] == protocol.INVALID_PARAMS


def test_connections_past_the_cap_are_refused_in_one_line_and_the_daemon_serves_on(daemon):
    """Clients that open many connections and send nothing take MAX_CONNECTIONS descriptors at
    most: the next is told why and closed, and a slot freed is served again."""
    from mtplxd.control.server import MAX_CONNECTIONS

    idle = []
    try:
        for _ in range(MAX_CONNECTIONS):
            sock = socket.socket(socket.AF_UNIX)
            sock.connect(str(daemon.paths.socket))
            idle.append(sock)
        status = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "daemon.status"}).encode() + b"\n"
        [refused] = _exchange_when_accepted(daemon.paths.socket, status)
        assert refused["error"]["data"]["reason"] == "busy"
        assert str(MAX_CONNECTIONS) in refused["error"]["message"]
        idle.pop().close()
        assert _answered_once_a_slot_frees(daemon, status)["result"]["pid"] == daemon.pid
    finally:
        for sock in idle:
            sock.close()
    assert _answered_once_a_slot_frees(daemon, status)["result"]["pid"] == daemon.pid


def _exchange_when_accepted(path, payload: bytes) -> list[dict]:
    """`_exchange` once the listen backlog has room (a connect to a full one fails at once)."""
    for _ in range(100):
        try:
            return _exchange(path, payload)
        except BlockingIOError:
            time.sleep(0.05)
    return _exchange(path, payload)


def _answered_once_a_slot_frees(daemon, request: bytes) -> dict:
    """The daemon counts a closed connection out when it reads the close: ask until it has."""
    for _ in range(100):
        [answer] = _exchange_when_accepted(daemon.paths.socket, request)
        if answer.get("error", {}).get("data", {}).get("reason") != "busy":
            return answer
        time.sleep(0.05)
    return answer


def test_a_connection_that_sends_nothing_is_closed_after_the_idle_time(tmp_path, monkeypatch):
    """In process, with the idle time cut to 0.2 s: the server hangs up on a silent client, and
    a client that asks in time is answered."""
    import trio

    from mtplxd.control import server
    from mtplxd.control.registry import MethodRegistry

    monkeypatch.setattr(server, "IDLE_SECONDS", 0.2)
    registry = MethodRegistry()

    async def ping(params, notify):
        return "pong"

    registry.add("ping", ping)
    path = tmp_path / "control.sock"

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve_control, path, registry)
            silent = await trio.open_unix_socket(str(path))
            with trio.fail_after(5):
                assert await silent.receive_some(100) == b""  # closed by the server
            talker = await trio.open_unix_socket(str(path))
            await talker.send_all(b'{"jsonrpc": "2.0", "id": 1, "method": "ping"}\n')
            with trio.fail_after(5):
                assert json.loads(await talker.receive_some(1000))["result"] == "pong"
            nursery.cancel_scope.cancel()

    trio.run(main)


@pytest.mark.skipif(not os.path.exists("/proc/self/limits"), reason="reads the daemon's limits from /proc")
def test_the_daemon_keeps_the_open_file_limit_it_was_given_not_mlx_lms(daemon):
    """Importing mlx_lm.utils sets the open-file limit to (2048, 4096); the daemon raises its
    soft limit to the hard one it inherited and lets mlx-lm lower neither (fd_limits.py)."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]  # what the daemon inherited
    line = next(line for line in open(f"/proc/{daemon.pid}/limits") if line.startswith("Max open files"))
    soft_seen, hard_seen = (int(v) for v in line.split()[3:5])
    assert (soft_seen, hard_seen) == (hard, hard)
