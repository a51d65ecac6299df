"""Context extension of the embedded model: the long-window training path computes what the
plain one does, the position-bucket evaluation adds up, and the entry runs end to end on CPU."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from training import evaluate, export, long_context
from training.mtp_model import TinyCoder, joint_loss
from training.train import TrainConfig, model_args

from .test_train_loss import write_tiny_data

WEIGHTS = (0.5, 0.25, 0.15)


def tiny_model(rope_theta=10000.0, seed=0) -> TinyCoder:
    mx.random.seed(seed)
    model = TinyCoder(model_args(TrainConfig(preset="tiny", rope_theta=rope_theta), 128))
    mx.eval(model.parameters())
    return model


def windows(rows, length, seed=0):
    return mx.array(np.random.default_rng(seed).integers(0, 128, (rows, length)).astype(np.int32))


def test_mtp_chain_on_the_last_anchors_equals_the_full_chain_there():
    model = tiny_model()
    x = windows(2, 44)
    h = model.hidden(x[:, :40])
    feeds = [x[:, 1 + s:41 + s] for s in range(3)]
    full = model.mtp_chain(h, feeds)
    tail = model.mtp_chain(h, feeds, tail=9)
    for f, t in zip(full, tail):
        assert t.shape == (2, 9, f.shape[-1])
        assert mx.allclose(f[:, -9:], t, atol=1e-5)  # equal up to matmul row-count rounding


def test_chunked_checkpointed_trunk_equals_the_plain_forward():
    model = tiny_model(rope_theta=1e6)
    x = windows(2, 50)
    # 50 tokens in chunks of 16: the last chunk is short, and each chunk sees every earlier key.
    assert mx.allclose(long_context.long_hidden(model, x, 16), model.hidden(x), atol=1e-5)


def test_long_loss_and_its_gradients_equal_joint_loss_when_the_tail_is_the_whole_window():
    model = tiny_model()
    x = windows(2, 36)
    ref = nn.value_and_grad(model, lambda m, w: joint_loss(m, w, WEIGHTS)[0])(model, x)
    got = nn.value_and_grad(model, lambda m, w: long_context.long_loss(m, w, WEIGHTS, 8, 32)[0])(model, x)
    assert abs(ref[0].item() - got[0].item()) < 1e-5
    ref_g, got_g = dict(tree_flatten(ref[1])), dict(tree_flatten(got[1]))
    assert ref_g.keys() == got_g.keys()
    for name, g in ref_g.items():
        assert mx.allclose(g, got_g[name], atol=1e-5), name


def test_loss_by_position_fed_in_chunks_equals_one_forward_bucket_by_bucket():
    model = tiny_model()
    tokens = np.random.default_rng(1).integers(0, 128, 500).astype(np.uint16)
    got = evaluate.loss_by_position(model, tokens, 64, 3, 24, [0, 16, 32, 64])
    assert [(b["from"], b["to"]) for b in got["buckets"]] == [(0, 16), (16, 32), (32, 64)]
    starts = got["starts"]
    assert starts[0] == 0 and starts[-1] == 500 - 65 and len(starts) == 3
    x = mx.array(np.stack([tokens[s:s + 65] for s in starts]).astype(np.int32))
    logits = model(x[:, :-1]).astype(mx.float32)
    ce = np.array((mx.logsumexp(logits, -1) - mx.take_along_axis(logits, x[:, 1:, None], -1)[..., 0]).mean(0))
    for b in got["buckets"]:
        assert abs(b["loss"] - float(ce[b["from"]:b["to"]].mean())) < 1e-3
        assert abs(b["ppl"] - float(np.exp(b["loss"]))) < 1e-2 * b["ppl"]


def test_entry_retrains_a_checkpoint_at_a_new_rope_base_on_mixed_windows_and_reports_both_models(tmp_path):
    data = write_tiny_data(tmp_path / "data")
    meta = json.loads((data / "meta.json").read_text())
    init_args = model_args(TrainConfig(preset="tiny"), meta["vocab_size"])
    init = export.write_checkpoint(TinyCoder(init_args), init_args, export_tokenizer_dir(), tmp_path / "init",
                                   meta["special_ids"]["<|im_end|>"])
    out = tmp_path / "out"
    long_context.main(["--data", str(data), "--out", str(out), "--init", str(init), "--preset", "tiny",
                       "--rope-theta", "500000", "--context", "128", "--seq-len", "96", "--batch", "2",
                       "--attn-chunk", "32", "--mtp-tail", "16", "--steps", "3", "--warmup", "1",
                       "--eval-len", "48", "--eval-windows", "2", "--eval-chunk", "20",
                       "--buckets", "0,16,32", "--quick-eval", "--short-per-long", "1",
                       "--short-batch", "3", "--short-seq-len", "24", "--cache-limit-gb", "0"])
    config = json.loads((out / "config.json").read_text())
    assert config["rope_theta"] == 500000 and config["max_position_embeddings"] == 128
    metrics = json.loads((out / "metrics.json").read_text())
    for key in ("eval_init", "eval_new"):
        buckets = metrics[key]["loss_by_position"]["buckets"]
        assert [(b["from"], b["to"]) for b in buckets] == [(0, 16), (16, 32), (32, 48)]
        assert all(np.isfinite(b["loss"]) for b in buckets)
    assert metrics["history"]["steps"] == 3
    # Steps alternate long (2 x 96 tokens) and short (3 x 24) windows: long, short, long.
    assert metrics["history"]["tokens"] == 2 * 96 + 3 * 24 + 2 * 96
    shards = sorted(out.glob("model-*.safetensors"))
    dest = tmp_path / "installed"
    export.install(out, dest, base=init)
    model = export.load_checkpoint(dest)
    assert model.args.rope_theta == 500000
    assert set(mx.load(str(dest / "model.safetensors"))) == set().union(*(mx.load(str(p)) for p in shards))


def export_tokenizer_dir():
    from .conftest import EMBEDDED_DIR
    return EMBEDDED_DIR
