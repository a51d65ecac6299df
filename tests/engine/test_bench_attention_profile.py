"""bench/attention_profile.py: one form of a layer's attention over a KV buffer a process.

On this CPU the two MLX forms run (the buffer kernel's need CUDA; the GPU run is
docs/benchmarks-data/h200-vector-qmm.sh's PART=attention-profile)."""

import json

import mlx.core as mx
import pytest

from mtplxd.engine.bench import attention_profile
from mtplxd.engine.decoding import buffer_attention
from mtplxd.engine.model.kv_cache import fixed_shapes_wanted

SMALL = {"heads": 4, "kv_heads": 2, "dim": 32}


def test_the_op_by_op_and_masked_forms_attend_alike():
    """`mlx` (the keys the last row sees, causal) and `masked` (the whole buffer, a mask)
    are one attention: rows at the context's end of a buffer with room to spare."""
    q = mx.random.normal((1, 4, 3, 32), key=mx.random.key(5)).astype(mx.bfloat16)
    mlx = attention_profile.attention_call("mlx", 40, 3, **SMALL)(q)
    masked = attention_profile.attention_call("masked", 40, 3, **SMALL)(q)
    assert mx.allclose(mlx.astype(mx.float32), masked.astype(mx.float32), atol=2e-2)


def test_run_reports_the_wall_per_call_and_the_shape():
    report = attention_profile.run("mlx", 40, 2, calls=2, repeats=1, profiled=False, shape=SMALL)
    assert report["slots"] == 40 + attention_profile.SPARE_SLOTS and report["rows"] == 2
    assert report["wall_us_per_call"] > 0 and not report["profiled"]


@pytest.mark.skipif(fixed_shapes_wanted(), reason="off CUDA only")
def test_the_kernel_forms_say_they_need_cuda(capsys):
    assert not buffer_attention.usable()
    with pytest.raises(SystemExit, match="needs the buffer kernel"):
        attention_profile.main(["--form", "split", "--context", "8", "--calls", "1", "--repeats", "1"])


def test_scalars_in_pool_holds_for_the_run_only():
    """--scalars-in-pool: the kernels' offset and scale as one-element arrays (MLX's managed
    pool) inside, the padded vectors back after, and the report says which it timed."""
    offset = mx.array(300, mx.int32)
    with buffer_attention.scalars_in_pool():
        assert buffer_attention.kernel_offsets(offset).tolist() == [300]
        assert buffer_attention.kernel_scale(0.5).nbytes == 4
    padded = buffer_attention.kernel_offsets(offset)
    assert padded.nbytes >= 16 and padded[0].item() == 300
    report = attention_profile.run("mlx", 40, 1, calls=1, repeats=1, profiled=False, shape=SMALL, in_pool=True)
    assert report["scalars_in_pool"] is True
    assert buffer_attention.SCALAR_VECTOR_ELEMENTS * 4 >= 16


@pytest.mark.skipif(not fixed_shapes_wanted(), reason="the buffer kernels need MLX's CUDA backend")
@pytest.mark.parametrize("form", ["one-pass", "split"])
def test_on_cuda_scalars_in_the_pool_or_padded_give_the_same_bits(form):
    q = mx.random.normal((1, 4, 2, 32), key=mx.random.key(5)).astype(mx.bfloat16)
    padded = attention_profile.attention_call(form, 300, 2, **SMALL)(q)
    with buffer_attention.scalars_in_pool():
        pooled = attention_profile.attention_call(form, 300, 2, **SMALL)(q)
        mx.eval(pooled)
    assert mx.array_equal(padded, pooled)


def test_main_writes_its_report(tmp_path):
    out = tmp_path / "a.json"
    assert attention_profile.main(["--form", "masked", "--context", "16", "--rows", "1", "--calls", "1",
                                   "--repeats", "1", "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["form"] == "masked" and report["heads"] == 64 and "attention_profile" in report["command"]
    assert report["scalars_in_pool"] is False


def test_main_takes_another_shape_and_refuses_partial_groups(tmp_path):
    out = tmp_path / "hybrid.json"
    assert attention_profile.main(["--form", "mlx", "--context", "8", "--heads", "6", "--kv-heads", "2",
                                   "--dim", "64", "--calls", "1", "--repeats", "1", "--json-out", str(out)]) == 0
    assert json.loads(out.read_text())["kv_heads"] == 2
    with pytest.raises(SystemExit):
        attention_profile.main(["--form", "mlx", "--heads", "6", "--kv-heads", "4"])


def test_the_kernels_shape_holds_for_the_run_only_and_must_be_whole_tiles(tmp_path, monkeypatch):
    """`--split-slots`, `--split-warps` and `--split-pairs` set the split form's chunk, warps
    a block and pairs a warp, `--mma-slots` and `--mma-warps` the mma form's chunk and warps,
    for this run (its report says which) and put the shipped ones back; a chunk that is not
    whole tiles (32 slots; 16 a warp for the mma form), or warps the kernel does not take, is
    refused."""
    names = ("SPLIT_SLOTS", "SPLIT_WARPS", "SPLIT_MAX_PAIRS", "MMA_SLOTS", "MMA_WARPS")
    seen = []
    real_run = attention_profile.run
    def run(*args, **kwargs):
        seen.append(tuple(getattr(buffer_attention, name) for name in names))
        return real_run(*args, **kwargs)
    monkeypatch.setattr(attention_profile, "run", run)
    shipped = tuple(getattr(buffer_attention, name) for name in names)
    out = tmp_path / "s.json"
    assert attention_profile.main(["--form", "mlx", "--context", "8", "--split-slots", "64", "--split-warps", "8",
                                   "--split-pairs", "1", "--mma-slots", "128", "--mma-warps", "8",
                                   "--calls", "1", "--repeats", "1", "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert seen == [(64, 8, 1, 128, 8)]
    assert [report[key] for key in ("split_slots", "split_warps", "split_pairs", "mma_slots", "mma_warps")] == [
        64, 8, 1, 128, 8]
    assert tuple(getattr(buffer_attention, name) for name in names) == shipped
    for bad in (["--split-slots", "48"], ["--split-warps", "3"], ["--split-pairs", "3"], ["--mma-slots", "96"],
                ["--mma-slots", "64", "--mma-warps", "8"], ["--mma-warps", "3"]):
        with pytest.raises(SystemExit):
            attention_profile.main(["--form", "mlx", *bad])
