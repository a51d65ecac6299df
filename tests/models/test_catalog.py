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
def test_recommended_model_by_a_macs_memory(memory, expected):
    assert recommended(memory, "metal").id == expected


@pytest.mark.parametrize("gpu_memory, expected", [
    (6, EMBEDDED_ID),
    (8, "Youssofal/Qwen3.5-4B-MTPLX-Optimized-Speed"),
    (12, "Youssofal/Qwen3.5-9B-MTPLX-Optimized-Speed"),
    (16, "Youssofal/Qwen3.5-9B-MTPLX-Optimized-Speed"),
    (24, "Youssofal/Qwen3.6-27B-MTPLX-Optimized-Speed"),
    (48, "Youssofal/Qwen3.6-27B-MTPLX-Optimized-Quality"),
    (141, "Youssofal/Qwen3.6-27B-MTPLX-Optimized-Quality"),
])
def test_recommended_model_by_an_nvidia_gpus_memory(gpu_memory, expected):
    """On CUDA the model lives in the GPU's own memory, nearly all of which it may take: a
    24 GB card takes the 4-bit 27B that a Mac needs 64 GB of unified memory for."""
    assert recommended(gpu_memory, "cuda").id == expected


@pytest.mark.parametrize("memory", [8, 24, 128, 512])
def test_the_cpu_alone_is_recommended_the_embedded_model_whatever_its_memory(memory):
    """Real models decode at seconds a token on MLX's CPU backend: no multi-GB download is
    offered there, and the catalog says why; the models still show whether they fit."""
    assert recommended(memory, "cpu").id == EMBEDDED_ID
    rows = available_models(memory, "cpu")
    assert [r["id"] for r in rows if r["recommended"]] == [EMBEDDED_ID]
    assert all(r["cpu_reason"] == catalog.CPU_REASON and r["memory_kind"] == "RAM" for r in rows)
    assert {r["id"]: r["fits"] for r in rows}["Youssofal/Qwen3.5-4B-MTPLX-Optimized-Speed"] is (memory >= 16)


class _Dist:
    def __init__(self, name: str) -> None:
        self.metadata = {"Name": name}


@pytest.mark.parametrize("platform, packages, gpu, expected", [
    ("darwin", ["mlx", "mlx-metal"], None, "metal"),
    ("linux", ["mlx", "mlx-cpu"], None, "cpu"),
    ("linux", ["mlx", "mlx-cpu"], "NVIDIA H200", "cpu"),  # a GPU, but MLX's CPU build
    ("linux", ["mlx", "mlx_cuda_13"], "NVIDIA H200", "cuda"),
    ("linux", ["mlx", "mlx-cuda-12"], None, "cpu"),  # the CUDA build, but no GPU the driver shows
])
def test_the_accelerator_is_read_from_mlxs_build_and_the_driver(platform, packages, gpu, expected):
    assert catalog.accelerator(lambda: [_Dist(n) for n in packages], lambda: gpu, platform) == expected


def test_the_gpus_memory_comes_from_nvidia_smi():
    class Done:
        def __init__(self, code: int, out: str) -> None:
            self.returncode, self.stdout = code, out

    asked = []

    def run(argv, **kwargs):
        asked.append(argv)
        return Done(0, "143771\n")

    assert catalog.gpu_memory_gb(run) == pytest.approx(140.4, abs=0.1)
    assert asked[0][0] == "nvidia-smi"
    assert catalog.gpu_memory_gb(lambda *a, **k: Done(9, "")) is None
    assert catalog.gpu_memory_gb(lambda *a, **k: Done(0, "[N/A]")) is None

    def missing(*args, **kwargs):
        raise FileNotFoundError("nvidia-smi")

    assert catalog.gpu_memory_gb(missing) is None


def test_start_recommended_on_the_cpu_alone_serves_the_embedded_model_and_says_why(monkeypatch, capsys):
    from mtplxctl.commands.models import ensure_default_model

    monkeypatch.setattr(catalog, "accelerator", lambda *a, **k: "cpu")
    assert ensure_default_model(pull=True) is None
    assert " ".join(capsys.readouterr().err.split()) == f"serving the embedded model: {catalog.CPU_REASON}"
    assert ensure_default_model(confirm=lambda question: pytest.fail("nothing to offer")) is None


def test_available_models_flags_fit_and_recommendation_and_ends_with_the_embedded_model():
    rows = available_models(32, "metal")
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
    monkeypatch.setattr(catalog, "accelerator", lambda *a, **k: "metal")  # this CPU is offered none


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
