"""`mtplxctl models ...` end to end: through a real daemon (progress as control-socket
notifications) and, with no daemon, in-process against the same store."""

from __future__ import annotations

import json

import pytest

from models.conftest import REPO, changed_config
from mtplxctl.cli import main
from support.daemon import run_ctl, start_daemon


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@pytest.fixture
def daemon(hub):
    """A daemon (no model) whose environment points huggingface_hub at the fake Hub."""
    running = start_daemon("--no-model", env={"HF_ENDPOINT": hub.url})
    try:
        yield running
    finally:
        running.stop()


def test_pull_streams_progress_notifications_through_the_daemon(hub, daemon, tiny_files):
    events = []
    result = daemon.client.call("models.pull", {"model": REPO},
                                on_notification=lambda name, params: events.append((name, params)),
                                timeout=None)
    assert result["revision"] == hub.repos[REPO].refs["main"] and result["mode"] == "mtp"
    assert {name for name, _ in events} == {"models.progress"}
    weights = [p for _, p in events if p.get("file") == "model.safetensors" and p["phase"] == "downloading"]
    assert weights[-1]["downloaded"] == weights[-1]["total"] == len(tiny_files["model.safetensors"])
    assert [p["phase"] for _, p in events][0] == "resolved"

    # The daemon serves what it pulled.
    loaded = daemon.client.call("model.load", {"model": REPO}, timeout=None)
    assert loaded["id"] == REPO and loaded["mode"] == "mtp"


def test_ctl_pull_json_lines_then_list_check_update_rm(hub, daemon, tiny_files):
    pulled = run_ctl("models", "pull", REPO, "--json")
    assert pulled.returncode == 0, pulled.stderr
    lines = json_lines(pulled.stdout)
    assert lines[0]["phase"] == "resolved"
    assert any(l["phase"] == "downloading" and l["file"] == "config.json" for l in lines)
    assert lines[-1]["phase"] == "done" and lines[-1]["model"]["id"] == REPO

    listed = json.loads(run_ctl("models", "list", "--json").stdout)["models"]
    assert [(m["id"], m["family"], m["mode"]) for m in listed] == [(REPO, "qwen3", "mtp")]

    new = hub.commit(REPO, changed_config(tiny_files, max_position_embeddings=777))
    check = run_ctl("models", "check")
    assert check.returncode == 0 and "outdated" in check.stdout

    updated = run_ctl("models", "update", REPO)
    assert updated.returncode == 0, updated.stderr
    assert f"→ {new[:12]}" in updated.stdout and "1 changed file(s) downloaded" in updated.stdout

    missing = run_ctl("models", "pull", "mtplx-test/missing", "--json")
    assert missing.returncode == 1
    assert json_lines(missing.stdout)[-1]["reason"] == "not_found"

    removed = run_ctl("models", "rm", REPO, "--json")
    assert json.loads(removed.stdout)["removed"] == [new]
    assert json.loads(run_ctl("models", "list", "--json").stdout)["models"] == []


def test_pull_without_a_daemon_runs_in_process(hub, capsys):
    assert main(["models", "pull", f"{REPO}@main"]) == 0
    out = capsys.readouterr().out
    assert f"pulled {REPO}" in out and "serving mode: MTP" in out
    assert main(["models", "list"]) == 0
    assert REPO in capsys.readouterr().out


def test_pull_errors_name_the_environment(hub, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["models", "pull", REPO, "--json"]) == 1
    [line] = json_lines(capsys.readouterr().out)
    assert line["phase"] == "error" and line["reason"] == "offline" and "HF_HUB_OFFLINE" in line["message"]

    monkeypatch.delenv("HF_HUB_OFFLINE")
    url = hub.url
    hub.stop()
    assert main(["models", "pull", REPO]) == 1
    err = capsys.readouterr().err
    assert url in err and "HF_ENDPOINT" in err


def test_list_available_shows_the_catalog_without_a_daemon(capsys):
    assert main(["models", "list", "--available", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["models"]
    assert rows[-1]["id"] == "mtplx-tiny-coder"
    assert sum(r["recommended"] for r in rows) == 1


def test_rm_of_an_unknown_model_fails_with_a_hint(capsys):
    assert main(["models", "rm", "org/never-pulled"]) == 1
    assert "not pulled" in capsys.readouterr().err


def _unfold(text: str) -> str:
    """The table's text with borders and line breaks gone, so folded cells read whole again."""
    return "".join(ch for ch in text if ch not in "│┃┏┓┗┛┡┩━─┼╇╋┳┻┃ \n└┘┌┐├┤┬┴╭╮╰╯")


def test_models_list_keeps_every_character_in_80_columns(hub, monkeypatch):
    """A narrow terminal folds long ids onto a second line instead of cutting them off."""
    from rich.console import Console

    import mtplxctl.commands.models as models_cmd

    assert main(["models", "pull", REPO, "--json"]) == 0
    for argv in (["models", "list"], ["models", "list", "--available"]):
        narrow = Console(width=80, record=True, highlight=False)
        monkeypatch.setattr(models_cmd, "console", narrow)
        assert main(argv) == 0
        shown = narrow.export_text()
        assert "…" not in shown and max(map(len, shown.splitlines())) <= 80, shown
        if argv == ["models", "list"]:
            revision = json.loads(run_ctl("models", "list", "--json").stdout)["models"][0]["revision"]
            assert REPO.replace(" ", "") in _unfold(shown) and revision[:12] in shown


def test_a_damaged_manifest_is_listed_and_removed_without_a_daemon(capsys):
    from mtplxd.paths import Paths
    from support.pulled import write_damaged_manifest

    manifest = write_damaged_manifest(Paths.from_env().models_dir, "bad/repo")
    assert main(["models", "list", "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)["models"]
    assert row["id"] == "bad/repo" and row["damaged"] is True
    assert main(["models", "list"]) == 0
    assert "bad/repo" in capsys.readouterr().out
    assert main(["models", "rm", "bad/repo"]) == 0
    assert "removed bad/repo" in capsys.readouterr().out and not manifest.exists()


def test_rm_of_the_embedded_model_says_it_is_built_in(capsys):
    assert main(["models", "rm", "mtplx-tiny-coder"]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "mtplx-tiny-coder is built into mtplx" in err and "cannot be removed" in err
    assert "models pull" not in err
