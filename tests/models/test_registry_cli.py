"""`mtplxctl models check --families` and `models check PATH`: the honest registry. Every family
mlx-lm or mlx-vlm can load is listed as MTP (with the head's depth), AR (with the reason) or
refused (with the reason); a local folder is judged the way the loader will judge it."""

from __future__ import annotations

import json

from mlx_lm.utils import MODEL_REMAPPING

from mtplxctl.cli import main
from mtplxd.engine.fixtures.tiny import write_tiny_checkpoint
from mtplxd.engine.fixtures.tiny_lfm2 import write_tiny_lfm2_checkpoint
from mtplxd.engine.fixtures.tiny_vision import write_tiny_vision_checkpoint
from mtplxd.engine.model.family_table import mlx_lm_families, mlx_vlm_families


def families(capsys) -> dict[str, dict]:
    assert main(["models", "check", "--families", "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert any("auto_map" in r for r in body["checkpoint_refusals"])
    return {row["model_type"]: row for row in body["families"]}


def test_every_family_mlx_lm_or_mlx_vlm_loads_is_listed_with_a_mode_and_a_reason(capsys):
    rows = families(capsys)
    assert set(rows) == mlx_lm_families() | mlx_vlm_families() | set(MODEL_REMAPPING)
    assert len(rows) > 200
    for row in rows.values():
        assert row["mode"] in ("mtp", "ar", "refused")
        assert row["mode"] == "mtp" or row["reason"], row  # AR and refused always say why


def test_mtp_families_carry_the_head_depth_and_lfm2_is_ar_because_it_has_no_head(capsys):
    rows = families(capsys)
    for family in ("qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_next"):
        assert rows[family]["mode"] == "mtp" and rows[family]["mtp_head_layers"] == 1
        assert rows[family]["draft_depth"].startswith("3 ")
    assert rows["qwen3_5"]["vision"] and not rows["qwen3"]["vision"]
    assert rows["lfm2"]["mode"] == "ar" and "no MTP head" in rows["lfm2"]["reason"]
    assert "high" in rows["lfm2"]["reasoning_effort"]
    assert rows["mistral"]["mode"] == "ar" and "loaded as 'llama'" in rows["mistral"]["reason"]
    assert rows["lfm2_vl"]["mode"] == "refused" and "mlx-vlm only" in rows["lfm2_vl"]["reason"]


def test_the_human_table_names_every_mode(capsys):
    assert main(["models", "check", "--families"]) == 0
    out = capsys.readouterr().out
    assert "MTP" in out and "AR" in out and "refused" in out and "lfm2" in out


def test_a_folder_is_judged_as_the_loader_will(capsys, tmp_path):
    lfm2 = write_tiny_lfm2_checkpoint(tmp_path / "lfm2")
    assert main(["models", "check", str(lfm2), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mode"] == "ar" and "no MTP head" in report["reason"]

    vision = write_tiny_vision_checkpoint(tmp_path / "vl")
    assert main(["models", "check", str(vision), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mode"] == "mtp" and report["vision"] is True

    gptq = write_tiny_checkpoint(tmp_path / "gptq", "qwen3", quantization_config={"quant_method": "gptq", "bits": 4})
    assert main(["models", "check", str(gptq)]) == 1
    assert "REFUSED" in capsys.readouterr().out

    bundled = write_tiny_checkpoint(tmp_path / "bundled", "llama", auto_map={"AutoModel": "x.Model"})
    assert main(["models", "check", str(bundled), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["mode"] == "refused" and "auto_map" in report["reason"]


def test_a_head_mtplx_cannot_build_is_named_as_such(capsys, tmp_path):
    import mlx.core as mx

    lfm2 = write_tiny_lfm2_checkpoint(tmp_path / "lfm2-with-head")
    tensors = dict(mx.load(str(lfm2 / "model.safetensors")))
    tensors["mtp.fc.weight"] = mx.zeros((64, 128))
    mx.save_safetensors(str(lfm2 / "model.safetensors"), tensors)
    assert main(["models", "check", str(lfm2), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mode"] == "ar" and "has mtp.* tensors" in report["reason"]
