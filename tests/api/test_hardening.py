"""Input and clients that used to get a 500 or hold a worker forever, against the real daemon:
lone UTF-16 surrogates in any text field, and request bodies that trickle in."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx
import pytest
import trio

from support.api_daemon import MODEL_ID, start_api_daemon

LONE = "\ud800"
SURROGATE_BODIES = {
    "/v1/chat/completions": ({"model": MODEL_ID, "max_tokens": 2,
                              "messages": [{"role": "user", "content": "hi " + LONE}]},
                             "messages[0].content"),
    "/v1/completions": ({"model": MODEL_ID, "max_tokens": 2, "prompt": LONE}, "prompt"),
    "/v1/responses": ({"model": MODEL_ID, "max_output_tokens": 2, "input": "a\udfffb"}, "input"),
    "/v1/messages": ({"model": MODEL_ID, "max_tokens": 2,
                      "messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
                     "messages[0].content[0].text"),
    "/v1/messages/count_tokens": ({"model": MODEL_ID, "system": LONE,
                                   "messages": [{"role": "user", "content": "hi"}]}, "system"),
}


@pytest.mark.parametrize("path", list(SURROGATE_BODIES))
def test_a_lone_surrogate_is_a_400_naming_the_field(api, path):
    body, field = SURROGATE_BODIES[path]
    with api.http() as http:
        # json.dumps writes the lone half as the escape `\ud800`, as a JavaScript client would.
        answer = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert "lone UTF-16 surrogate" in error["message"] and field in error["message"]
    if path.startswith("/v1/messages"):
        assert answer.json()["type"] == "error" and error["type"] == "invalid_request_error"
    else:
        assert error["param"] == field and error["code"] == "invalid_unicode"


def test_a_lone_surrogate_in_a_key_is_named_escaped(api):
    body = {"model": MODEL_ID, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
            "metadata": {"k" + LONE: 1}}
    with api.http() as http:
        answer = http.post("/v1/chat/completions", content=json.dumps(body),
                           headers={"content-type": "application/json"})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "metadata.k\\ud800"


def test_a_surrogate_pair_is_ordinary_text(api):
    body = {"model": MODEL_ID, "max_tokens": 2, "messages": [{"role": "user", "content": "ok \ud83d\ude00"}]}
    with api.http() as http:
        answer = http.post("/v1/chat/completions", content=json.dumps(body),
                           headers={"content-type": "application/json"})
    assert answer.status_code == 200, answer.text


# -- bodies that trickle in -------------------------------------------------------------------

BODY_TIMEOUT = 2


@pytest.fixture(scope="module")
def impatient_api(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    daemon = start_api_daemon(tmp_path_factory.mktemp("impatient-home"), MTPLX_MODEL=str(tiny_checkpoint),
                              MTPLX_BODY_TIMEOUT_SECONDS=str(BODY_TIMEOUT))
    try:
        yield daemon
    finally:
        daemon.stop()


async def _trickle(port: int, body: bytes, every: float, give_up: float) -> tuple[bytes, float]:
    """Send headers, then the body one byte per `every` seconds; return what the server
    answered and when (seconds since the headers), or b"" if it never answered in `give_up`."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        await stream.send_all(head)
        started = trio.current_time()
        answer = b""

        async def drip() -> None:
            for byte in body:
                await trio.sleep(every)
                try:
                    await stream.send_all(bytes([byte]))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return

        with trio.move_on_after(give_up):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(drip)
                while chunk := await stream.receive_some(65536):
                    answer += chunk
                    if b"\r\n\r\n" in answer:
                        break
                nursery.cancel_scope.cancel()
        return answer, trio.current_time() - started


def test_a_body_sent_one_byte_a_second_gets_a_408_and_frees_its_worker(impatient_api):
    body = json.dumps({"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 2}).encode()
    results: list[tuple[bytes, float]] = []
    served_meanwhile: list[int] = []

    async def main() -> None:
        async def one() -> None:
            results.append(await _trickle(impatient_api.port, body, every=0.5, give_up=BODY_TIMEOUT + 20))

        async def normal_request() -> None:
            await trio.sleep(0.5)
            with impatient_api.http() as http:
                answer = await trio.to_thread.run_sync(lambda: http.get("/v1/models"))
            served_meanwhile.append(answer.status_code)

        async with trio.open_nursery() as nursery:
            for _ in range(20):
                nursery.start_soon(one)
            nursery.start_soon(normal_request)

    trio.run(main)
    assert served_meanwhile == [200], "slow uploads held back an ordinary request"
    assert len(results) == 20
    for answer, seconds in results:
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert seconds < BODY_TIMEOUT + 10
    assert impatient_api.process.poll() is None


def test_a_body_that_arrives_in_time_is_served(impatient_api):
    body = json.dumps({"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 1}).encode()
    with socket.create_connection(("127.0.0.1", impatient_api.port), timeout=30) as sock:
        sock.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode())
        for piece in (body[:10], body[10:]):
            time.sleep(0.3)
            sock.sendall(piece)
        answer = b""
        while b"\r\n\r\n" not in answer and (chunk := sock.recv(65536)):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]


@pytest.mark.parametrize("method, path", [("POST", "/metrics"), ("POST", "/nope"), ("PATCH", "/health"),
                                          ("PUT", "/v1/models"), ("POST", "/v1/embeddings")])
def test_an_error_answered_before_the_body_was_read_does_not_stall_the_connection(api, method, path):
    # The body's bytes used to stay on the keep-alive connection, and the client's next request
    # on it waited forever (one in three tries here).
    with httpx.Client(base_url=api.base_url, timeout=10) as http:
        for _ in range(6):
            refused = http.request(method, path, content=b'{"input": "' + b"x" * 2000 + b'"}')
            assert refused.status_code in (404, 405) and refused.json()["error"]
            assert http.get("/health").status_code == 200


def test_a_refused_field_name_cannot_forge_a_log_line(api):
    forged = "\n2026-01-01 00:00:00,000 ERROR mtplxd: forged\n"
    body = {"model": MODEL_ID, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
            "metadata": {"k" + forged + LONE: 1}}
    with api.http() as http:
        answer = http.post("/v1/chat/completions", content=json.dumps(body),
                           headers={"content-type": "application/json"})
    assert answer.status_code == 400
    log = (api.home / "logs" / "mtplxd.log").read_text(errors="replace")
    assert "POST /v1/chat/completions 400 " in log and "refused: invalid_unicode" in log
    assert not any(line.startswith("2026-01-01") for line in log.splitlines())


def test_an_idle_keep_alive_connection_does_not_hold_up_stop(tiny_checkpoint, tmp_path, monkeypatch):
    """Agents keep pooled connections open between requests. With one idle after a request and
    a long shutdown grace, `stop` (which waits 30 s) still finds the daemon gone: the grace is
    for generations in flight, not for idle connections."""
    import socket

    from support.api_daemon import start_api_daemon
    from support.daemon import run_ctl

    daemon = start_api_daemon(tmp_path / "home", MTPLX_MODEL=str(tiny_checkpoint),
                              MTPLX_SHUTDOWN_GRACE_SECONDS="45")
    try:
        pooled = socket.create_connection(("127.0.0.1", daemon.port))
        pooled.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        assert pooled.recv(65536).startswith(b"HTTP/1.1 200")
        monkeypatch.setenv("MTPLX_HOME", str(daemon.home))
        done = run_ctl("stop")
        assert done.returncode == 0, done.stdout + done.stderr
        assert daemon.process.wait(5) == 0
        pooled.close()
    finally:
        daemon.stop()
