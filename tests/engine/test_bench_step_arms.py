"""bench.step_arms: configurations of whole decode steps alternating in one process, at tiny
dims on this CPU (the kernel through its plain-ops twin)."""

from __future__ import annotations

import json

import pytest

from mtplxd.engine.bench import step_arms


def test_an_arm_is_known_features_joined_by_plus():
    assert step_arms.parse_arm("stock") == frozenset()
    assert step_arms.parse_arm("kernel+row-invariant+stacked") == {"kernel", "row-invariant", "stacked"}
    assert step_arms.parse_arm("kernel+mixed+compiled-ar") == {"kernel", "mixed", "compiled-ar"}
    for bad in ("", "kernal", "compiled-ar+op-by-op-ar", "row-invariant", "mixed", "kernel+mixed+row-invariant"):
        with pytest.raises(ValueError):
            step_arms.parse_arm(bad)


def test_arms_alternate_and_each_round_is_set_against_the_first_arms(tmp_path):
    out = tmp_path / "arms.json"
    assert step_arms.main(["--size", "tiny", "--dtype", "bf16", "--arms", "stock,compiled-ar+stacked",
                           "--rounds", "2", "--steps", "3", "--context", "16", "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    stock, other = report["arms"]["stock"], report["arms"]["compiled-ar+stacked"]
    assert stock["loop"] == "ar" and other["loop"] == "ar compiled"  # the loop forced per arm
    assert stock["stacked_groups"] == 0 and other["stacked_groups"] > 0  # a model of its own
    assert len(stock["wall_ms_per_step"]) == len(other["cpu_ms_per_step"]) == 2
    ratio = report["ratio_to_first"]["compiled-ar+stacked"]
    assert ratio["by_round"] == pytest.approx([o / s for o, s in zip(other["wall_ms_per_step"],
                                                                      stock["wall_ms_per_step"])])
    assert "stock" not in report["ratio_to_first"]


def test_kernel_arms_route_one_model_in_turn(small_m_kernel_twin, tmp_path):
    calls = small_m_kernel_twin
    report = step_arms.run_arms("tiny", "4bit", ["kernel", "kernel+row-invariant"], steps=2, rounds=1, context=16)
    served, invariant = report["arms"]["kernel"], report["arms"]["kernel+row-invariant"]
    assert served["kernel_layers"] > 0 and invariant["kernel_layers"] == served["kernel_layers"]
    assert "mma" in {layout for rows, layout in calls if rows == 1}  # row-invariant: 1-row steps on mma


def test_a_mixed_arm_keeps_the_mixed_routing_where_row_invariant_is_served(small_m_kernel_twin, monkeypatch):
    """`mixed` times the routing a model would have had before row-invariant was served for
    it (a dense 8-bit 32B since 2026-12-07): here the environment asks for row-invariant, as
    the default does for that model, and the arm's 1-row steps still leave the mma layout."""
    from mtplxd.engine.model import small_m_qmm

    monkeypatch.setenv(small_m_qmm.ROW_INVARIANT_ENV, "1")
    calls = small_m_kernel_twin
    report = step_arms.run_arms("tiny", "8bit", ["kernel+mixed"], steps=2, rounds=1, context=16)
    assert report["arms"]["kernel+mixed"]["kernel_layers"] > 0
    assert not [layout for rows, layout in calls if rows == 1]  # 8-bit mixed: decode steps on MLX's matvec
    calls.clear()
    step_arms.run_arms("tiny", "8bit", ["kernel"], steps=2, rounds=1, context=16)
    assert {layout for rows, layout in calls if rows == 1} == {"mma"}  # as served: row-invariant


@pytest.mark.parametrize("arguments", [["--arms", "stock,stock"], ["--arms", "stock", "--rounds", "0"],
                                       ["--arms", "stock,turbo"]])
def test_bad_arguments_are_refused(arguments):
    with pytest.raises(SystemExit):
        step_arms.main(arguments)
