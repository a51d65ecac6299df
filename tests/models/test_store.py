"""The model store against a local fake Hub: pull, pin, resume, update, repair, offline."""

from __future__ import annotations

import hashlib
import json
import threading

import pytest

from models.conftest import REPO, changed_config
from mtplxd.models.hub import ModelStoreError
from mtplxd.models.store import resolve_pulled


def test_pull_records_the_exact_commit_and_serves_the_snapshot(hub, store, tiny_files):
    events = []
    result = store.pull(REPO, progress=events.append)

    sha = hub.repos[REPO].refs["main"]
    assert result["revision"] == sha and result["requested"] is None
    assert result["mode"] == "mtp" and result["has_mtp_tensors"] is True
    assert result["tokenizer"] == "tokenizer.json"
    folder, served = resolve_pulled(REPO, store.models_dir)
    assert served == REPO and folder.name == sha
    for name, data in tiny_files.items():
        if name in ("pytorch_model.bin", ".gitattributes"):
            assert not (folder / name).exists()
        else:
            assert (folder / name).read_bytes() == data
    manifest = json.loads((store.models_dir / "manifests" / "mtplx-test--Tiny-MTP.json").read_text())
    assert manifest["current"] == sha
    weights = next(f for f in manifest["revisions"][sha]["files"] if f["path"] == "model.safetensors")
    assert weights["sha256"] == hashlib.sha256(tiny_files["model.safetensors"]).hexdigest()
    progress = [e for e in events if e["phase"] == "downloading" and e["file"] == "model.safetensors"]
    assert progress[-1]["downloaded"] == progress[-1]["total"] == len(tiny_files["model.safetensors"])
    assert "model.safetensors" in result["downloaded"]


def test_pull_again_downloads_nothing_and_load_works(hub, store):
    store.pull(REPO)
    before = len(hub.resolve_gets())
    result = store.pull(REPO)
    assert result["downloaded"] == [] and result["repaired"] == []
    assert len(hub.resolve_gets()) == before

    from mtplxd.engine import load_model

    folder, served = resolve_pulled(REPO, store.models_dir)
    model = load_model(folder, model_id=served)
    assert model.info.id == REPO and model.info.mode == "mtp"


def test_pin_to_a_revision_keeps_that_commit_after_main_moves(hub, store, tiny_files):
    first = hub.repos[REPO].refs["main"]
    second = hub.commit(REPO, changed_config(tiny_files, max_position_embeddings=1024))

    pinned = store.pull(f"{REPO}@{first}")
    assert pinned["revision"] == first and pinned["requested"] == first
    assert pinned["context_length"] != 1024
    folder, _ = resolve_pulled(f"{REPO}@{first[:8]}", store.models_dir)
    assert folder.name == first

    [row] = store.check(REPO)
    assert row["pinned"] and row["status"] == "outdated" and row["hub_revision"] == second


def test_pull_by_branch_name_and_check_latest(hub, store, tiny_files):
    dev = hub.commit(REPO, changed_config(tiny_files, rope_theta=5000.0), branch="dev")
    result = store.pull(f"{REPO}@dev")
    assert result["revision"] == dev and result["requested"] == "dev"
    [row] = store.check()
    assert row["status"] == "latest" and row["tracking"] == "dev"
    assert resolve_pulled(f"{REPO}@dev", store.models_dir)[0].name == dev


def test_resume_after_a_cut_connection(hub, store, tiny_files, monkeypatch):
    import huggingface_hub.constants

    # huggingface_hub writes (and so can resume from) whole chunks of DOWNLOAD_CHUNK_SIZE
    # (10 MiB); a smaller chunk makes the tiny weights file behave like a multi-chunk shard.
    chunk = 64 * 1024
    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", chunk)
    hub.cut_once.add("model.safetensors")
    size = len(tiny_files["model.safetensors"])

    result = store.pull(REPO)

    gets = hub.gets_of("/model.safetensors")
    assert len(gets) == 2
    assert gets[0].range is None
    # The retry asks only for the bytes after the last chunk written before the cut.
    resumed_at = int(gets[1].range.removeprefix("bytes=").removesuffix("-"))
    assert resumed_at == (size // 2) // chunk * chunk > 0
    folder, _ = resolve_pulled(REPO, store.models_dir)
    assert (folder / "model.safetensors").read_bytes() == tiny_files["model.safetensors"]
    assert result["repaired"] == []


def test_interrupted_pull_keeps_finished_files_and_the_next_pull_fetches_the_rest(hub, store, tiny_files):
    from mtplxd.models.progress import PullCancelled

    # The weights download is held back until every small file is done, then the pull is stopped.
    small = set(tiny_files) - {"model.safetensors", "pytorch_model.bin", ".gitattributes"}
    done, stop, released = set(), threading.Event(), threading.Event()
    hub.hold["model.safetensors"] = released

    def progress(event):
        if event["phase"] == "downloading" and event["file"] in small and event["downloaded"] == event["total"]:
            done.add(event["file"])
            if done == small:
                stop.set()
                released.set()

    with pytest.raises(PullCancelled):
        store.pull(REPO, progress=progress, should_stop=stop.is_set)
    assert resolve_pulled(REPO, store.models_dir) is None  # nothing recorded until complete

    hub.requests.clear()
    result = store.pull(REPO)
    assert result["downloaded"] == ["model.safetensors"]
    assert [g.path.rsplit("/", 1)[1] for g in hub.resolve_gets()] == ["model.safetensors"]
    assert resolve_pulled(REPO, store.models_dir) is not None


def test_partial_files_of_a_killed_pull_are_cleaned_up(hub, store):
    blobs = store.repo_dir(REPO) / "blobs"
    blobs.mkdir(parents=True)
    leftover = blobs / "0123abcd.deadbeef.incomplete"  # what a SIGKILLed download leaves
    leftover.write_bytes(b"partial")
    store.pull(REPO)
    assert not leftover.exists()


def test_update_downloads_only_the_changed_file(hub, store, tiny_files):
    old = store.pull(REPO)["revision"]
    new = hub.commit(REPO, changed_config(tiny_files, max_position_embeddings=2048))
    hub.requests.clear()

    [row] = store.check(REPO)
    assert row["status"] == "outdated" and row["hub_revision"] == new

    result = store.update(REPO)

    assert result["updated"] and result["from"] == old and result["to"] == new
    assert result["downloaded"] == ["config.json"]
    assert [g.path.rsplit("/", 1)[1] for g in hub.resolve_gets()] == ["config.json"]
    assert "model.safetensors" in result["reused"]
    folder, _ = resolve_pulled(REPO, store.models_dir)
    assert folder.name == new and json.loads((folder / "config.json").read_text())["max_position_embeddings"] == 2048
    # The superseded commit is gone; the shared weights blob stays for the new one.
    assert not store.snapshot_path(REPO, old).exists()
    assert [r["revision"] for r in store.list_models()] == [new]
    assert store.check(REPO)[0]["status"] == "latest"
    assert store.update(REPO)["updated"] is False


def test_corrupted_local_file_is_detected_and_repaired(hub, store, tiny_files):
    store.pull(REPO)
    folder, _ = resolve_pulled(REPO, store.models_dir)
    weights = folder / "model.safetensors"
    damaged = bytearray(weights.read_bytes())
    damaged[len(damaged) // 2] ^= 0x01
    weights.resolve().write_bytes(bytes(damaged))
    hub.requests.clear()

    events = []
    result = store.pull(REPO, progress=events.append)

    assert result["repaired"] == ["model.safetensors"]
    assert any(e["phase"] == "repairing" and "sha256" in e["reason"] for e in events)
    assert [g.path.rsplit("/", 1)[1] for g in hub.resolve_gets()] == ["model.safetensors"]
    assert weights.read_bytes() == tiny_files["model.safetensors"]


def test_a_download_whose_hash_disagrees_is_refetched_once(hub, store, tiny_files):
    hub.corrupt_once.add("model.safetensors")
    result = store.pull(REPO)
    assert result["repaired"] == ["model.safetensors"]
    folder, _ = resolve_pulled(REPO, store.models_dir)
    assert (folder / "model.safetensors").read_bytes() == tiny_files["model.safetensors"]


def test_a_file_that_never_matches_is_not_kept(hub, store, tiny_files):
    hub.corrupt_always.add("model.safetensors")
    with pytest.raises(ModelStoreError) as caught:
        store.pull(REPO)
    assert caught.value.reason == "integrity" and "model.safetensors" in caught.value.message
    assert not store.snapshot_path(REPO, hub.repos[REPO].refs["main"]).joinpath("model.safetensors").exists()
    weights_blob = hashlib.sha256(tiny_files["model.safetensors"]).hexdigest()
    assert not (store.repo_dir(REPO) / "blobs" / weights_blob).exists()
    assert resolve_pulled(REPO, store.models_dir) is None


def test_offline_mode_names_hf_hub_offline(hub, store, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelStoreError) as caught:
        store.pull(REPO)
    assert caught.value.reason == "offline" and "HF_HUB_OFFLINE" in caught.value.message
    assert hub.requests == []


def test_unreachable_hub_names_hf_endpoint(hub, store, monkeypatch):
    url = hub.url
    hub.stop()
    monkeypatch.setenv("HF_ENDPOINT", url)
    with pytest.raises(ModelStoreError) as caught:
        store.pull(REPO)
    assert caught.value.reason == "unreachable"
    assert url in caught.value.message and "HF_ENDPOINT" in caught.value.message
    assert "HF_HUB_OFFLINE" in caught.value.message


def test_check_is_unknown_when_the_hub_cannot_answer(hub, store, monkeypatch):
    store.pull(REPO)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    [row] = store.check()
    assert row["status"] == "unknown" and "HF_HUB_OFFLINE" in row["reason"]
    monkeypatch.delenv("HF_HUB_OFFLINE")
    del hub.repos[REPO]
    [row] = store.check()
    assert row["status"] == "unknown" and "not found" in row["reason"]


def test_missing_repo_and_revision_have_clear_errors(hub, store):
    with pytest.raises(ModelStoreError) as caught:
        store.pull("mtplx-test/nope")
    assert caught.value.reason == "not_found"
    with pytest.raises(ModelStoreError) as caught:
        store.pull(f"{REPO}@no-such-branch")
    assert caught.value.reason == "revision_not_found"
    with pytest.raises(ModelStoreError) as caught:
        store.pull("not a repo")
    assert caught.value.reason == "invalid_spec"


def test_list_and_remove(hub, store, tiny_files):
    first = store.pull(REPO)["revision"]
    second = hub.commit(REPO, changed_config(tiny_files, max_position_embeddings=3000))
    store.pull(f"{REPO}@{second}")

    rows = store.list_models()
    assert {r["revision"] for r in rows} == {first, second}
    assert [r["current"] for r in rows if r["revision"] == second] == [True]
    row = rows[0]
    assert row["family"] == "qwen3" and row["mode"] == "mtp" and row["size_bytes"] > 0

    removed = store.remove(f"{REPO}@{second}")
    assert removed["removed"] == [second] and removed["freed_bytes"] > 0
    assert resolve_pulled(REPO, store.models_dir)[0].name == first  # current falls back
    removed = store.remove(REPO)
    assert removed["removed"] == [first]
    assert store.list_models() == [] and not store.repo_dir(REPO).exists()
    with pytest.raises(ModelStoreError) as caught:
        store.remove(REPO)
    assert caught.value.reason == "not_pulled"


def test_resolve_pulled_is_none_for_unknown_specs(store):
    assert resolve_pulled("org/none", store.models_dir) is None
    assert resolve_pulled("/a/local/folder/that/does/not/exist", store.models_dir) is None
    assert resolve_pulled("", store.models_dir) is None


def test_pull_reports_ar_and_why_for_a_checkpoint_without_mtp_tensors(hub, store, tmp_path):
    from mtplxd.engine.fixtures.tiny import write_tiny_checkpoint

    folder = write_tiny_checkpoint(tmp_path / "plain", "qwen3", with_mtp=False, fit_mtp=False)
    hub.commit("mtplx-test/Plain", {p.name: p.read_bytes() for p in folder.iterdir()})
    result = store.pull("mtplx-test/Plain")
    assert result["mode"] == "ar" and result["has_mtp_tensors"] is False
    assert "mtp" in result["reason"]
    [row] = [r for r in store.list_models() if r["id"] == "mtplx-test/Plain"]
    assert row["mode"] == "ar" and row["reason"] == result["reason"]


def test_pull_marks_a_folder_without_a_tokenizer_refused(hub, store, tiny_files):
    files = {k: v for k, v in tiny_files.items() if not k.startswith("tokenizer")}
    hub.commit("mtplx-test/NoTokenizer", files)
    result = store.pull("mtplx-test/NoTokenizer")
    assert result["mode"] == "refused" and "tokenizer" in result["reason"]


def test_a_repo_without_safetensors_is_refused_before_downloading(hub, store):
    hub.commit("mtplx-test/TorchOnly", {"config.json": b"{}", "pytorch_model.bin": b"\0" * 8})
    with pytest.raises(ModelStoreError) as caught:
        store.pull("mtplx-test/TorchOnly")
    assert caught.value.reason == "no_weights"
    assert hub.resolve_gets() == []


def test_a_damaged_manifest_is_listed_named_and_removable(store):
    from mtplxd.models.manifest import DamagedManifest
    from support.pulled import write_damaged_manifest

    manifest = write_damaged_manifest(store.models_dir, "bad/repo")
    [row] = store.list_models()
    assert row["id"] == "bad/repo" and row["damaged"] is True and row["mode"] == "damaged"
    assert row["size_bytes"] == 4096 and "mtplxctl models rm bad/repo" in row["reason"]
    with pytest.raises(DamagedManifest) as caught:
        resolve_pulled("bad/repo", store.models_dir)
    assert caught.value.reason == "damaged_manifest"
    assert "mtplxctl models rm bad/repo" in caught.value.message
    assert "mtplxctl models pull bad/repo" in caught.value.message
    with pytest.raises(DamagedManifest):  # its revisions are unknown: only the whole repo goes
        store.remove("bad/repo@main")
    removed = store.remove("BAD/repo")  # repo ids are case-insensitive
    assert removed["repo"] == "bad/repo" and removed["freed_bytes"] == 4096
    assert not manifest.exists() and not store.repo_dir("bad/repo").exists()
    assert store.list_models() == []


def test_pulling_again_repairs_a_damaged_manifest(hub, store):
    from support.pulled import write_damaged_manifest

    write_damaged_manifest(store.models_dir, REPO)
    store.pull(REPO)
    [row] = store.list_models()
    assert row["damaged"] is False and row["revision"] == hub.repos[REPO].refs["main"]


def test_the_embedded_model_cannot_be_removed(store):
    from mtplxd.models.builtin import EMBEDDED_MODEL_ID  # the id the daemon serves it under

    assert EMBEDDED_MODEL_ID == "mtplx-tiny-coder"
    for spec in (EMBEDDED_MODEL_ID, "mtplx-tiny-coder"):
        with pytest.raises(ModelStoreError) as caught:
            store.remove(spec)
        assert caught.value.reason == "built_in"
    assert "built into mtplx" in caught.value.message and "pull" not in caught.value.message
