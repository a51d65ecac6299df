"""The catalog of recommended models and the model `mtplxctl start` picks when none is named."""

from __future__ import annotations

import json

import pytest

from models.conftest import REPO
from mtplxd.models import catalog
from mtplxd.models.catalog import EMBEDDED_ID, CatalogEntry, available_models, recommended
from mtplxd.paths import Paths


@pytest.mark.parametrize("memory, expected", [
    (8, EMBEDDED_ID),
    (16, "Youssofal/Qwen3.5-4B-MTPLX-Optimized-Speed"),
    (24, "Youssofal/Qwen3.5-4B-MTPLX-Optimized-Speed"),
    (32, "Youssofal/Qwen3.5-9B-MTPLX-Optimized-Speed"),
    (64, "Youssofal/Qwen3.6-27B-MTPLX-Optimized-Speed"),
    (96, "Youssofal/Qwen3.6-27B-MTPLX-Optimized-Speed"),
    (128, "Youssofal/Qwen3.6-27B-MTPLX-Optimized-Quality"),
    (512, "Youssofal/Qwen3.6-27B-MTPLX-Optimized-Quality"),
])
def test_recommended_model_by_machine_memory(memory, expected):
    assert recommended(memory).id == expected


def test_available_models_flags_fit_and_recommendation_and_ends_with_the_embedded_model():
    rows = available_models(32)
    assert [r["id"] for r in rows if r["recommended"]] == ["Youssofal/Qwen3.5-9B-MTPLX-Optimized-Speed"]
    assert {r["id"]: r["fits"] for r in rows}["Youssofal/Qwen3.6-27B-MTPLX-Optimized-Speed"] is False
    assert rows[-1]["id"] == EMBEDDED_ID and rows[-1]["fits"]
    # Only ids seen in the reference notes are marked verified.
    assert [r["id"] for r in rows if r["verified"] and r["id"] != EMBEDDED_ID] == [
        "Youssofal/Qwen3.5-4B-MTPLX-Optimized-Speed"]


@pytest.fixture
def test_catalog(monkeypatch):
    """A catalog whose only entry is the fake Hub's repo, for any machine."""
    entry = CatalogEntry(REPO, 0, "tiny", 0.001, "none", True, "test")
    monkeypatch.setattr(catalog, "CATALOG", (entry,))


def test_default_choice_is_the_pick_when_the_hub_confirms_it(hub, test_catalog):
    assert catalog.default_model_choice(Paths.from_env()) == REPO


def test_default_choice_is_embedded_offline_or_when_the_pick_is_missing(hub, test_catalog, monkeypatch):
    paths = Paths.from_env()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert catalog.default_model_choice(paths) is None
    monkeypatch.delenv("HF_HUB_OFFLINE")
    del hub.repos[REPO]
    assert catalog.default_model_choice(paths) is None
    hub.stop()
    assert catalog.default_model_choice(paths) is None


def test_default_choice_is_a_pulled_pick_even_offline(hub, test_catalog, store, monkeypatch):
    store.pull(REPO)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert catalog.default_model_choice(Paths.from_env()) == REPO


def test_start_recommended_pulls_the_pick_once(hub, test_catalog, capsys):
    from mtplxctl.commands.models import ensure_default_model

    assert ensure_default_model(pull=True) == REPO
    assert "pulling the recommended" in capsys.readouterr().err
    gets = len(hub.resolve_gets())
    assert ensure_default_model(pull=True) == REPO  # already pulled: nothing downloaded
    assert ensure_default_model() == REPO  # a plain start serves a pulled pick too
    assert len(hub.resolve_gets()) == gets


def test_interactive_start_offers_the_pick_and_pulls_only_on_yes(hub, test_catalog, capsys):
    from mtplxctl.commands.models import ensure_default_model

    questions: list[str] = []

    def decline(question: str) -> bool:
        questions.append(question)
        return False

    assert ensure_default_model(confirm=decline) is None
    assert REPO in questions[0] and "GB" in questions[0]
    assert hub.resolve_gets() == []  # declined: nothing downloaded
    assert ensure_default_model(confirm=lambda question: True) == REPO
    assert "pulling the recommended" in capsys.readouterr().err


def test_plain_start_never_downloads_the_pick(hub, test_catalog):
    from mtplxctl.commands.models import ensure_default_model

    assert ensure_default_model() is None  # not pulled: the embedded model is served
    assert hub.resolve_gets() == []


def test_start_recommended_serves_the_catalog_pick(hub, test_catalog, capsys):
    from mtplxctl.cli import main

    try:
        assert main(["start", "--recommended", "--json"]) == 0
        status = json.loads(capsys.readouterr().out)  # progress went to stderr
        assert status["model"]["id"] == REPO and status["model"]["mode"] == "mtp"
    finally:
        main(["stop"])


def test_start_without_a_model_keeps_a_configured_one(hub, test_catalog, isolated_home):
    from mtplxctl.commands.models import ensure_default_model

    (isolated_home / "config.toml").parent.mkdir(parents=True, exist_ok=True)
    (isolated_home / "config.toml").write_text('model = "/some/folder"\n')
    assert ensure_default_model(pull=True) is None
    assert hub.requests == []
