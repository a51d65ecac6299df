"""bench.launch_cost: chains of kernels that do no work, compiled, to time a kernel's floor.
MLX's own form runs on any backend; the cuda_kernel forms on a GPU."""

import json
import statistics

import mlx.core as mx
import pytest

from mtplxd.engine.bench import launch_cost
from mtplxd.engine.model.kv_cache import fixed_shapes_wanted

needs_cuda = pytest.mark.skipif(not fixed_shapes_wanted(), reason="cuda_kernel is CUDA only")


def test_a_chain_applies_its_kernel_once_an_op():
    x = mx.ones(launch_cost.SHAPE) * 3
    want = x
    for _ in range(4):
        want = mx.fast.rms_norm(want, None, 1e-5)
    assert mx.array_equal(launch_cost.chain("norm", 4)(x), want)


def test_the_report_has_each_forms_medians_and_rounds(tmp_path):
    out = tmp_path / "launch.json"
    assert launch_cost.main(["--ops", "3", "--iterations", "2", "--rounds", "2", "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    forms = launch_cost.FORMS if fixed_shapes_wanted() else ("norm",)
    assert tuple(report["forms"]) == forms and report["ops"] == 3
    for row in report["forms"].values():
        assert len(row["rounds"]["pipelined"]) == 2 and row["us_per_kernel_waited"] > 0
        assert row["us_per_kernel_pipelined"] == statistics.median(row["rounds"]["pipelined"])


@pytest.mark.parametrize("arguments", [["--ops", "0"], ["--rounds", "0"]])
def test_empty_runs_are_refused(arguments):
    with pytest.raises(SystemExit):
        launch_cost.main(arguments)


@needs_cuda
@pytest.mark.parametrize("form", ["custom", "custom-padded"])
def test_cuda_custom_forms_add_one_a_kernel(form):
    x = mx.zeros(launch_cost.SHAPE)
    assert mx.array_equal(launch_cost.chain(form, 5, pad=2000)(x), x + 5)
