"""The daemon's lifecycle, driven as a user drives it: mtplxctl subprocesses, real signals."""

from __future__ import annotations

import json
import os
import re
import signal
import stat

import httpx
import pytest

from mtplxd.instance import lock_is_held
from mtplxd.paths import Paths

from support.daemon import run_ctl, start_daemon
from support.waiting import wait_gone


def test_start_status_stop_round_trip_through_mtplxctl():
    started = run_ctl("start", "--port", "0", "--json")
    assert started.returncode == 0, started.stderr
    status = json.loads(started.stdout)
    pid = status["pid"]
    assert status["http"]["base_url"].startswith("http://127.0.0.1:")

    shown = run_ctl("status", "--json")
    assert shown.returncode == 0
    assert json.loads(shown.stdout)["pid"] == pid

    human = run_ctl("status")
    assert "running, pid" in human.stdout and "Powered by MTPLX" in human.stdout

    stopped = run_ctl("stop")
    assert stopped.returncode == 0, stopped.stderr
    assert wait_gone(pid)
    paths = Paths.from_env()
    assert not paths.socket.exists() and not paths.pid_file.exists()

    after = run_ctl("status")
    assert after.returncode == 3
    assert "not running" in after.stderr


def test_status_without_daemon_exits_3_with_json_answer():
    result = run_ctl("status", "--json")
    assert result.returncode == 3
    assert json.loads(result.stdout) == {"running": False}


def test_second_daemon_exits_at_once_naming_the_running_pid(daemon):
    import subprocess
    import sys

    second = subprocess.run([sys.executable, "-m", "mtplxd", "--no-model"], capture_output=True,
                            text=True, timeout=30, env={**os.environ, "MTPLX_PORT": "0"})
    assert second.returncode == 1
    assert f"already running (pid {daemon.pid})" in second.stderr
    assert daemon.client.is_running()


def test_start_when_running_reuses_the_daemon(daemon):
    result = run_ctl("start", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["pid"] == daemon.pid


def test_start_says_already_running_only_of_a_daemon_it_did_not_start():
    fresh = run_ctl("start", "--port", "0")
    try:
        assert fresh.returncode == 0, fresh.stderr
        assert "already running" not in fresh.stderr  # it launched this one: port 0 is any port
        port = json.loads(run_ctl("status", "--json").stdout)["http"]["port"]
        assert "already running" not in run_ctl("start", "--port", "0").stderr
        assert "already running" not in run_ctl("start", "--port", str(port)).stderr
        other = run_ctl("start", "--port", str(port + 1 if port < 65535 else port - 1))
        assert "already running on 127.0.0.1:" in " ".join(other.stderr.split())
    finally:
        assert run_ctl("stop").returncode == 0


def test_sigterm_and_sigint_shut_down_cleanly(tmp_path):
    for sig in (signal.SIGTERM, signal.SIGINT):
        running = start_daemon("--no-model")
        assert running.stop(sig) == 0
        assert not running.paths.socket.exists()
        assert not running.paths.pid_file.exists()
        assert not lock_is_held(running.paths.lock_file)


def test_kill_9_leaves_nothing_that_blocks_the_next_start():
    first = start_daemon("--no-model")
    first.process.kill()
    first.process.wait(10)
    assert first.paths.socket.exists()  # the dead daemon's socket is still there ...
    second = start_daemon("--no-model")  # ... and the next start replaces it
    try:
        assert second.client.call("daemon.status")["pid"] == second.pid
    finally:
        assert second.stop() == 0


def test_run_directory_is_0700_and_socket_is_0600(daemon):
    run_mode = stat.S_IMODE(os.stat(daemon.paths.run_dir).st_mode)
    sock_mode = stat.S_IMODE(os.stat(daemon.paths.socket).st_mode)
    assert run_mode == 0o700
    assert sock_mode == 0o600
    assert stat.S_ISSOCK(os.stat(daemon.paths.socket).st_mode)


def test_pid_and_log_files_are_0600_and_logs_is_0700(daemon):
    # Logs name models, paths and clients: private like the run directory.
    def mode(path):
        return stat.S_IMODE(os.stat(path).st_mode)

    assert mode(daemon.paths.pid_file) == 0o600
    assert mode(daemon.paths.log_file) == 0o600
    assert mode(daemon.paths.logs_dir) == 0o700


def test_a_log_file_left_world_readable_is_made_private_at_start():
    home = Paths.from_env().home
    (home / "logs").mkdir(parents=True, mode=0o755)
    (home / "logs" / "mtplxd.log").write_text("an older run's line\n")
    os.chmod(home / "logs" / "mtplxd.log", 0o644)
    running = start_daemon("--no-model")
    try:
        assert stat.S_IMODE(os.stat(home / "logs").st_mode) == 0o700
        assert stat.S_IMODE(os.stat(home / "logs" / "mtplxd.log").st_mode) == 0o600
    finally:
        running.stop()


def test_long_home_falls_back_to_a_short_socket_path(tmp_path, monkeypatch):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    monkeypatch.setenv("MTPLX_HOME", str(deep))
    running = start_daemon("--no-model")
    try:
        status = running.client.call("daemon.status")
        assert status["socket_fallback"] is True
        assert status["socket"].startswith(f"/tmp/mtplx-{os.getuid()}/")
        assert stat.S_IMODE(os.stat(os.path.dirname(status["socket"])).st_mode) == 0o700
        shown = run_ctl("status")
        assert "short fallback path" in shown.stdout
    finally:
        assert running.stop() == 0


def test_logs_shows_the_daemon_log(daemon):
    result = run_ctl("logs", "-n", "20")
    assert result.returncode == 0
    assert "ready: control" in result.stdout


def test_restart_gives_a_new_pid(daemon):
    result = run_ctl("restart", "--port", "0", "--json")
    assert result.returncode == 0, result.stderr
    new_pid = json.loads(result.stdout)["pid"]
    assert new_pid != daemon.pid
    assert daemon.process.wait(10) == 0
    assert run_ctl("stop").returncode == 0


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_restart_keeps_the_port_model_and_depth_it_was_started_with(tiny_model_factory,
                                                                     monkeypatch):
    """`restart` is the same daemon again: what `start` was given on its command line stays
    (agents are configured for that port), unless given anew or changed in config.toml."""
    monkeypatch.delenv("MTPLX_PORT")  # the tests' MTPLX_PORT=0 would outrank config.toml
    model, port = tiny_model_factory("qwen3"), _free_port()
    started = run_ctl("start", "--port", str(port), "--model", str(model), "--depth", "2", "--json")
    assert started.returncode == 0, started.stderr
    try:
        again = run_ctl("restart", "--json")
        assert again.returncode == 0, again.stderr
        status = json.loads(again.stdout)
        assert status["pid"] != json.loads(started.stdout)["pid"]
        assert status["http"]["port"] == port
        assert status["model"]["id"] == model.name and status["model"]["depth"] == 2
        human = run_ctl("restart")
        assert human.returncode == 0, human.stderr
        assert f"restarting as it ran: --port {port} --model {model} --depth 2" in human.stderr
        # An option given to restart wins; the others still carry.
        changed = json.loads(run_ctl("restart", "--depth", "1", "--json").stdout)
        assert changed["model"]["depth"] == 1 and changed["http"]["port"] == port
        assert changed["model"]["id"] == model.name
        # A port set in config.toml since the start wins over the start's --port, as
        # `config set` said ("takes effect at the next mtplxctl restart").
        other = _free_port()
        assert run_ctl("config", "set", "port", str(other)).returncode == 0
        moved = json.loads(run_ctl("restart", "--json").stdout)
        assert moved["http"]["port"] == other and moved["model"]["depth"] == 1
    finally:
        assert run_ctl("stop").returncode == 0


def test_start_with_a_model_loads_it_and_status_shows_it(tiny_model_factory):
    model = tiny_model_factory("qwen3")
    started = run_ctl("start", "--port", "0", "--model", str(model), "--json")
    try:
        assert started.returncode == 0, started.stderr
        loaded = json.loads(started.stdout)["model"]
        assert loaded["state"] == "loaded" and loaded["mode"] == "mtp" and loaded["demo"] is False
        assert loaded["context_length"] <= loaded["model_context_length"]
        human = run_ctl("status")
        assert f"{model.name} — MTP depth" in human.stdout
        assert "memory guard" in human.stdout
        assert loaded["kernels"]["quantized_matmul"] == "mlx (the small-M kernel is CUDA only)"
        assert "quantized matmul: mlx (the small-M kernel is CUDA only)" in human.stdout
        # The numerics profile `auto` resolved to on this machine (exact on OpenBLAS).
        assert re.search(r"cohorts\s+widths 1,3,8, numerics (exact|throughput), 0 paused", human.stdout)
    finally:
        assert run_ctl("stop").returncode == 0


@pytest.mark.parametrize("variable, value, field, served, shown", [
    ("MTPLX_DECODE_LOOP", "fused", "decode_loop", "fused", "(fused loop)"),
    ("MTPLX_QUANTIZE", "8bit", "quantization", "8bit, at load", "8bit, at load"),
])
def test_engine_setting_reaches_the_engine_and_serves(tiny_model_factory, monkeypatch,
                                                      variable, value, field, served, shown):
    """`decode_loop = fused` and `quantize = 8bit` (here from the environment) are what the
    loaded model runs and what status shows, and a greedy MTP request through the HTTP API
    still gives the AR tokens."""
    monkeypatch.setenv(variable, value)
    model = tiny_model_factory("qwen3")
    started = run_ctl("start", "--port", "0", "--model", str(model), "--json")
    try:
        assert started.returncode == 0, started.stderr
        status = json.loads(started.stdout)
        assert status["model"][field] == served
        assert shown in run_ctl("status").stdout
        answers = []
        for depth in (0, 3):
            body = {"model": status["model"]["id"], "prompt": "def add(a, b):", "max_tokens": 24,
                    "temperature": 0, "mtp_depth": depth}
            reply = httpx.post(status["http"]["base_url"] + "/completions", json=body, timeout=60)
            assert reply.status_code == 200, reply.text
            answers.append(reply.json()["choices"][0]["text"])
        assert answers[0] == answers[1] and answers[0]
    finally:
        assert run_ctl("stop").returncode == 0


def test_start_with_a_bad_model_says_what_to_do():
    result = run_ctl("start", "--port", "0", "--model", "no-such-org/no-such-model")
    try:
        assert result.returncode == 1
        assert "mtplxctl models pull no-such-org/no-such-model" in result.stderr
        assert "Traceback" not in result.stderr
    finally:
        run_ctl("stop")


@pytest.mark.parametrize("setting, path", [
    (None, "numpy block-wise (long prefill)"),
    ("mlx", "mlx scaled_dot_product_attention"),
])
def test_cpu_attention_setting_picks_the_long_prefill_path_and_serves_exactly(
        tiny_model_factory, monkeypatch, setting, path):
    """The daemon computes long prompts' attention as `cpu_attention` says (status names the
    path), and a greedy MTP answer to a prompt long enough for the numpy path is the AR one."""
    if setting is not None:
        monkeypatch.setenv("MTPLX_CPU_ATTENTION", setting)
    started = run_ctl("start", "--port", "0", "--model", str(tiny_model_factory("qwen3")), "--json")
    try:
        assert started.returncode == 0, started.stderr
        status = json.loads(started.stdout)
        assert status["model"]["kernels"]["prefill_attention"] == path
        prompt = " ".join(f"x{i} = add(x{i - 1}, {i})" for i in range(1, 120))
        answers = []
        for depth in (0, 3):
            body = {"model": status["model"]["id"], "prompt": prompt, "max_tokens": 16,
                    "temperature": 0, "mtp_depth": depth}
            reply = httpx.post(status["http"]["base_url"] + "/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["prompt_tokens"] >= 256  # long enough for numpy
            answers.append(reply.json()["choices"][0]["text"])
        assert answers[0] == answers[1] and answers[0]
    finally:
        assert run_ctl("stop").returncode == 0


def test_a_failure_after_the_daemon_served_is_not_called_a_failure_to_start(monkeypatch, capsys):
    """In process: a background task that raises an OSError once the daemon is up ends it with
    a line that says it had started and where the traceback is, not "cannot start"."""
    import errno

    import mtplxd.__main__ as daemon_main
    import mtplxd.daemon
    from mtplxd.paths import Paths

    async def failing_watch(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(mtplxd.daemon, "watch_pressure", failing_watch)
    assert daemon_main.main(["--no-model", "--port", "0"]) == daemon_main.EXIT_ERROR
    said = capsys.readouterr().err
    assert "stopped by an error after it had started: Input/output error" in said
    assert "cannot start" not in said
    log = Paths.from_env().log_file.read_text()
    assert "mtplxd stopped by an error" in log and "Traceback" in log


def _one_line(text: str) -> str:
    return " ".join(text.split())  # rich wraps long lines


def test_restart_with_a_broken_config_leaves_the_daemon_running(daemon):
    daemon.paths.config_file.write_text("{not toml\n")
    result = run_ctl("restart")
    said = _one_line(result.stderr)
    assert result.returncode == 1
    assert "cannot restart: configuration error" in said and "is not valid TOML" in said
    assert f"mtplxd (pid {daemon.pid}) is still running, nothing was stopped" in said
    assert daemon.process.poll() is None
    assert daemon.client.call("daemon.status")["pid"] == daemon.pid


def test_restart_on_a_host_it_cannot_listen_on_leaves_the_daemon_running(daemon, monkeypatch):
    monkeypatch.setenv("MTPLX_API_KEY", "sk-test-restart")  # a key, so only the bind can fail
    result = run_ctl("restart", "--host", "10.255.255.1")
    said = _one_line(result.stderr)
    assert result.returncode == 1
    assert "could not listen on 10.255.255.1" in said and "--host 127.0.0.1" in said
    assert daemon.process.poll() is None


@pytest.mark.parametrize("host, why", [
    ("10.255.255.1", "10.255.255.1 is not an address of this machine"),
    ("not-a-host.invalid", "the host 'not-a-host.invalid' does not resolve"),
])
def test_a_host_it_cannot_bind_is_named_with_what_to_do(host, why, monkeypatch):
    import subprocess
    import sys

    monkeypatch.setenv("MTPLX_API_KEY", "sk-test-bind")  # non-loopback needs a key
    result = subprocess.run([sys.executable, "-m", "mtplxd", "--host", host, "--port", "8123"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    said = result.stderr.strip().splitlines()[-1]
    assert said.startswith(f"mtplxd: cannot listen on {host}:8123: {why}"), said
    assert "use 127.0.0.1 or an address of this machine" in said


def test_a_stopped_daemon_is_named_with_its_pid_socket_and_what_to_do(daemon):
    from mtplxctl.client import ControlClient, DaemonNotAnswering

    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        with pytest.raises(DaemonNotAnswering):
            ControlClient(daemon.paths.socket, timeout=0.5).call("daemon.status")
        result = run_ctl("stop")  # its first call waits 5s
        said = _one_line(result.stderr)
        assert result.returncode == 1
        assert (f"mtplxd (pid {daemon.pid}) did not answer on {daemon.paths.socket} within 5s; "
                "it is stopped") in said
        assert f"kill -CONT {daemon.pid}" in said and "timed out" not in said
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    assert daemon.client.is_running()


def test_a_daemon_that_does_not_answer_but_runs_is_called_hung_with_a_way_out():
    from pathlib import Path

    from mtplxctl.cli import not_answering_text
    from mtplxctl.client import DaemonNotAnswering

    error = DaemonNotAnswering(Path("/run/mtplx.sock"), 30.0)
    said, hint = not_answering_text(error, os.getpid())  # this process: running, not stopped
    assert said == f"mtplxd (pid {os.getpid()}) did not answer on /run/mtplx.sock within 30s; " \
                   "it may be hung or very busy"
    assert f"kill {os.getpid()}" in hint and "mtplxctl start" in hint
    said, hint = not_answering_text(error, None)
    assert said.startswith("mtplxd did not answer on /run/mtplx.sock") and "mtplxctl logs" in hint


def test_a_status_check_of_a_stopped_daemon_answers_within_ten_seconds(daemon):
    """`status` is a person's quick look: a daemon that cannot answer (SIGSTOP) is named as
    stopped after 10 s, not after the 30 s a long operation may wait."""
    import time

    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        result = run_ctl("status")
        waited = time.monotonic() - started
        said = _one_line(result.stderr)
        assert result.returncode == 1
        assert (f"mtplxd (pid {daemon.pid}) did not answer on {daemon.paths.socket} within 10s; "
                "it is stopped") in said
        assert waited < 13, waited  # the 10 s limit and mtplxctl's own start
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    assert daemon.client.is_running()


def _missing_folder(daemon) -> str:
    return str(daemon.paths.home.parent / "missing" / "folder")


@pytest.mark.parametrize("flag", ["--embedding-model", "--reranker-model"])
def test_restart_refuses_a_retrieval_model_folder_that_is_not_there_before_stopping(daemon, flag):
    missing = _missing_folder(daemon)
    result = run_ctl("restart", flag, missing)
    said = _one_line(result.stderr)
    assert result.returncode == 1
    assert f"cannot restart: {flag.strip('-').removesuffix('-model')} model {missing} (given with {flag}) " \
           f"cannot be loaded: no such folder: {missing}" in said
    assert f"mtplxd (pid {daemon.pid}) is still running, nothing was stopped" in said
    assert "models pull" not in said
    assert daemon.process.poll() is None and daemon.client.call("daemon.status")["pid"] == daemon.pid


def test_restart_refuses_an_embedding_repo_that_is_not_pulled_saying_to_pull_it(daemon):
    """As for `--model`: a repo id that is not pulled would load nothing, so restart says so
    (with the pull that fixes it) while the running daemon still serves."""
    result = run_ctl("restart", "--embedding-model", "no-such-org/no-such-embedder")
    said = _one_line(result.stderr)
    assert result.returncode == 1
    assert "embedding model no-such-org/no-such-embedder (given with --embedding-model) cannot be " \
           "loaded" in said
    assert "mtplxctl models pull no-such-org/no-such-embedder" in said
    assert daemon.process.poll() is None


def test_restart_refuses_an_embedding_model_of_config_toml_that_is_not_there(daemon):
    missing = _missing_folder(daemon)
    daemon.paths.config_file.write_text(f'embedding_model = ["{missing}"]\n')
    result = run_ctl("restart")
    said = _one_line(result.stderr)
    assert result.returncode == 1
    assert f"embedding model {missing} (the `embedding_model` of config.toml) cannot be loaded: " \
           f"no such folder: {missing}" in said
    assert "mtplxctl config set embedding_model VALUE" in said
    assert daemon.process.poll() is None


def test_start_on_a_running_daemon_refuses_a_missing_embedding_folder_and_notes_a_good_one(
        daemon, tmp_path):
    """`start --embedding-model` on a running daemon: a folder that is not there is an error;
    a good one is noted as waiting for a restart (the running daemon keeps what it serves)."""
    from mtplxd.engine.fixtures.retrieval import write_tiny_embedding_checkpoint

    missing = _missing_folder(daemon)
    refused = run_ctl("start", "--embedding-model", missing)
    assert refused.returncode == 1
    assert f"no such folder: {missing}" in _one_line(refused.stderr)
    embedder = write_tiny_embedding_checkpoint(tmp_path / "embedder")
    noted = run_ctl("start", "--embedding-model", str(embedder))
    assert noted.returncode == 0, noted.stderr
    assert ("mtplxd is already running; the embedding and reranker options apply when it starts: "
            f"`mtplxctl restart --embedding-model {embedder}`") in _one_line(noted.stderr)
    assert daemon.process.poll() is None


def test_a_daemon_given_a_missing_embedding_folder_says_no_such_folder_in_its_log_and_404():
    """The daemon serves on without it; its log and the 404 name the folder that is not
    there, not a `models pull` of a filesystem path."""
    paths = Paths.from_env()
    missing = str(paths.home.parent / "missing" / "Qwen3-Embedding-0.6B")
    running = start_daemon("--no-model", "--embedding-model", missing)
    try:
        log = paths.log_file.read_text()
        assert f"not serving embedding model {missing}: no such folder: {missing}" in log
        assert "models pull" not in log
        base_url = running.client.call("daemon.status")["http"]["base_url"]
        reply = httpx.post(base_url + "/embeddings", json={"input": "hello"}, timeout=30)
        assert reply.status_code == 404
        message = reply.json()["error"]["message"]
        assert f"the daemon started with {missing}, which cannot be loaded (no such folder" in message
        assert "mtplxctl restart --embedding-model PATH_OR_REPO" in message
    finally:
        running.stop()


def test_restart_keeps_a_missing_embedding_folder_the_running_daemon_was_started_with():
    """The running daemon already serves without it: restart carries it as it ran (the new
    daemon logs why again) rather than refusing, or stopping and then refusing."""
    paths = Paths.from_env()
    missing = str(paths.home.parent / "missing" / "embedder")
    running = start_daemon("--no-model", "--embedding-model", missing)
    try:
        result = run_ctl("restart", "--json")
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["pid"] != running.pid
        assert running.process.wait(10) == 0
    finally:
        run_ctl("stop")
