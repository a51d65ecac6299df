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


def assert_uncut(shown: str, width: int) -> None:
    """Nothing cut: no ellipsis, no line over `width`, and every table line still ends in its
    right border (a table wider than the terminal loses its right side, not its ellipses)."""
    lines = shown.splitlines()
    assert "…" not in shown and max(map(len, lines)) <= width, shown
    for line in lines:
        if line[:1] in "┏┃┡│└":
            assert line.rstrip()[-1] in "┓┃┩│┘", shown


def test_a_pulled_list_of_long_ids_fits_80_columns_dropping_the_date_before_cutting(monkeypatch):
    """Real repo ids and an AR reason: the table loses its optional columns (pulled date,
    quant, family) rather than its right side; every id stays whole."""
    from rich.console import Console

    import mtplxctl.commands.models as models_cmd

    pulled = [{"id": "Youssofal/Qwen3.5-4B-MTPLX-Optimized-Speed", "revision": "0123456789ab" * 3,
               "requested": "main", "current": True, "present": True, "size_bytes": 3 << 30,
               "family": "qwen3_5", "mode": "mtp", "quantization": "4bit", "pulled_at": "2026-12-01T00:00"},
              {"id": "mlx-community/Llama-3.2-1B-Instruct-4bit", "revision": "fedcba987654" * 3,
               "current": True, "present": True, "size_bytes": 1 << 30, "family": "llama", "mode": "ar",
               "reason": "no MTP head in the checkpoint", "quantization": "4bit",
               "pulled_at": "2026-12-01T00:00"}]
    monkeypatch.setattr(models_cmd, "run_operation", lambda *args, **kwargs: {"models": pulled})
    for width in (80, 100, 200):
        narrow = Console(width=width, record=True, highlight=False)
        monkeypatch.setattr(models_cmd, "console", narrow)
        assert main(["models", "list"]) == 0
        shown = narrow.export_text()
        assert_uncut(shown, width)
        ids = "".join(line.split("│")[1].strip() for line in shown.splitlines() if line.startswith("│"))
        assert ids == "".join(row["id"] for row in pulled), shown  # folded, every character kept
        assert ("2026-12-01" in shown) is (width == 200), shown


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
        assert_uncut(shown, 80)
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


@pytest.mark.parametrize("spec, is_path", [
    ("/abs/folder", True), ("~/models/LFM2-1.2B", True), ("./LFM2", True), ("../LFM2", True),
    ("models/org/name", True), ("org/name", False), ("org/name@refs/pr/1", False),
    ("mtplx-tiny-coder", False), ("LFM2", False)])
def test_a_spec_is_a_path_when_it_looks_like_one(spec, is_path):
    from mtplxd.models.spec import looks_like_path

    assert looks_like_path(spec) is is_path


def test_a_path_that_names_no_folder_is_called_that_by_every_command(capsys, tmp_path, monkeypatch):
    """models check|pull|rm, config set and start --model read a path as a path: "no such
    folder", never a Hub repo-id error, and start launches nothing."""
    from mtplxd.paths import Paths

    monkeypatch.chdir(tmp_path)
    missing = tmp_path / "models" / "LFM2-1.2B"
    for argv in (["models", "check", str(missing)], ["models", "pull", str(missing)],
                 ["models", "check", "./models/LFM2-1.2B"], ["models", "rm", "./models/LFM2-1.2B"],
                 ["config", "set", "model", str(missing)],
                 ["config", "set", "embedding_model", f"org/embedder,{missing}"],
                 ["start", "--model", "./models/LFM2-1.2B"]):
        assert main(argv) == 1, argv
        said = " ".join(capsys.readouterr().err.split())
        assert f"no such folder: {missing}" in said, (argv, said)
        assert "Repo id" not in said and "org/name, or org/name@REVISION" not in said, said
    assert not Paths.from_env().socket.exists()  # start refused before launching a daemon
    assert main(["models", "check", "--json", str(missing)]) == 1
    assert json.loads(capsys.readouterr().out)["reason"] == "local_path"
    assert main(["models", "pull", str(tmp_path)]) == 1
    said = " ".join(capsys.readouterr().err.split())
    assert f"{tmp_path} is a folder on this machine, not a Hub repo" in said


def test_config_set_stores_a_model_folder_as_an_absolute_path(capsys, tmp_path, monkeypatch):
    """The daemon reads config.toml from its own working folder: a relative path is stored
    absolute; a repo id as given (it may be pulled later)."""
    from mtplxd.config import load_config
    from mtplxd.paths import Paths

    (tmp_path / "mine").mkdir()
    monkeypatch.chdir(tmp_path)
    assert main(["config", "set", "model", "./mine"]) == 0
    assert main(["config", "set", "embedding_model", "org/embedder,mine"]) == 0
    config = load_config(Paths.from_env().config_file)
    assert config.model == str(tmp_path / "mine")
    assert config.embedding_model == ["org/embedder", str(tmp_path / "mine")]


def test_the_daemons_load_of_a_missing_folder_says_no_such_folder(tmp_path):
    from mtplxd.models.resolve import ModelLoadFailed, resolve_model

    with pytest.raises(ModelLoadFailed) as failed:
        resolve_model(str(tmp_path / "gone"), tmp_path)
    assert str(failed.value).startswith(f"no such folder: {tmp_path / 'gone'}")
    assert "models pull" not in str(failed.value)
