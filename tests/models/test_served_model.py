"""The model the daemon serves, against the store: `models rm` refuses it, and `restart`
refuses to stop the daemon when the model it would load again is gone; a damaged manifest is
named by `start`. A real daemon, a real tiny model laid out as a pulled one."""

from __future__ import annotations

import json

from mtplxd.paths import Paths
from support.daemon import run_ctl, start_daemon
from support.pulled import fake_pull, write_damaged_manifest

SERVED = "test/tiny"


def _text(result) -> str:
    return " ".join(result.stderr.split())  # rich wraps long lines


def test_rm_refuses_the_served_model_and_restart_refuses_once_it_is_gone(tiny_model_factory):
    folder = fake_pull(Paths.from_env().models_dir, SERVED, tiny_model_factory("qwen3"))
    started = run_ctl("start", "--port", "0", "--model", SERVED, "--json")
    try:
        assert started.returncode == 0, started.stderr
        pid = json.loads(started.stdout)["pid"]

        refused = run_ctl("models", "rm", SERVED)
        assert refused.returncode == 1
        assert f"{SERVED} is the model mtplxd (pid {pid}) is serving" in _text(refused)
        assert "mtplxctl start --model OTHER" in _text(refused)
        assert folder.is_dir()

        # `--force` removes it anyway, and says the next start needs another model.
        from mtplxctl.client import ControlClient

        client = ControlClient(Paths.from_env().socket)
        removed = run_ctl("models", "rm", SERVED, "--force")
        assert removed.returncode == 0, removed.stderr
        assert "it was the model mtplxd serves" in _text(removed) and not folder.exists()

        again = run_ctl("restart")
        assert again.returncode == 1
        assert f"model {SERVED} (the model it runs now) cannot be loaded" in _text(again)
        assert f"mtplxd (pid {pid}) is still running, nothing was stopped" in _text(again)
        status = client.call("daemon.status")
        assert status["pid"] == pid and status["model"]["state"] == "loaded"
    finally:
        assert run_ctl("stop").returncode == 0


def test_start_names_a_damaged_manifest_and_how_to_fix_it():
    write_damaged_manifest(Paths.from_env().models_dir, "bad/repo")
    running = start_daemon("--no-model")
    try:
        result = run_ctl("start", "--model", "bad/repo")
        assert result.returncode == 1
        assert "the manifest of bad/repo" in _text(result) and "is damaged" in _text(result)
        assert "mtplxctl models rm bad/repo" in _text(result)
        assert "internal" not in _text(result) and "Traceback" not in result.stderr
        removed = run_ctl("models", "rm", "bad/repo", "--json")  # through the daemon
        assert removed.returncode == 0, removed.stderr
        assert json.loads(removed.stdout)["damaged"] is True
    finally:
        running.stop()


def test_a_configured_model_with_a_damaged_manifest_leaves_the_daemon_up_and_says_why():
    """The model config.toml names has a damaged manifest: the load at start fails as any load
    that finds no model does (the daemon serves on, with no model, and logs what to do); it
    used to escape the start as the store's own error and end the daemon."""
    import time

    paths = Paths.from_env()
    write_damaged_manifest(paths.models_dir, "bad/repo")
    paths.config_file.parent.mkdir(parents=True, exist_ok=True)
    paths.config_file.write_text('model = "bad/repo"\n')
    running = start_daemon()
    try:
        for _ in range(100):  # the load runs in the background after the daemon answers
            if "no model loaded at start" in paths.log_file.read_text():
                break
            time.sleep(0.1)
        assert running.process.poll() is None
        assert running.client.call("daemon.status")["model"] is None
        log = paths.log_file.read_text()
        assert "the manifest of bad/repo" in log and "mtplxctl models rm bad/repo" in log
    finally:
        running.stop()
