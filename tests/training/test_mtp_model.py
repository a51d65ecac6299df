"""The parallel MTP chain used for training equals the engine's step-by-step cached forward."""

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from training.mtp_model import TinyCoder, TinyCoderArgs


def tiny_model(seed: int = 0) -> TinyCoder:
    mx.random.seed(seed)
    args = TinyCoderArgs(model_type="qwen3", hidden_size=64, num_hidden_layers=2,
                         intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, rms_norm_eps=1e-6, vocab_size=97,
                         max_position_embeddings=256, tie_word_embeddings=True, rope_theta=10000.0)
    model = TinyCoder(args)
    mx.eval(model.parameters())
    return model


def mtp_input(model: TinyCoder, token: mx.array, h: mx.array) -> mx.array:
    m = model.mtp
    emb = model.model.embed_tokens(token)
    return m.fc(mx.concatenate([m.pre_fc_norm_embedding(emb), m.pre_fc_norm_hidden(h)], axis=-1))


def test_parallel_mtp_chain_matches_cached_draft_steps_depth_3():
    model = tiny_model()
    tokens = mx.array(np.random.default_rng(0).integers(0, 97, (1, 24)).astype(np.int32))
    length, depth = 20, 3
    h = model.hidden(tokens[:, :length])
    feeds = [tokens[:, 1 + s:length + 1 + s] for s in range(depth)]
    parallel = model.mtp_chain(h, feeds)
    layer = model.mtp.layers[0]
    for anchor in (0, 5, 19):
        # Engine: the MTP cache holds step-0 entries of anchors 0..anchor (entry j <-> position j).
        cache = KVCache()
        x0 = mtp_input(model, feeds[0][:, :anchor + 1], h[:, :anchor + 1])
        g = model.mtp.norm(layer(x0, create_attention_mask(x0, None), cache))[:, -1:]
        assert mx.allclose(g[:, 0], parallel[0][:, anchor], atol=1e-4)
        for step in range(1, depth):
            x = mtp_input(model, feeds[step][:, anchor:anchor + 1], g)
            g = model.mtp.norm(layer(x, None, cache))
            assert mx.allclose(g[:, 0], parallel[step][:, anchor], atol=1e-4), (anchor, step)


def test_checkpoint_weight_names_follow_the_dense_qwen3_mtp_contract():
    from mlx.utils import tree_flatten

    names = {k for k, _ in tree_flatten(tiny_model().parameters())}
    expected_mtp = {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight",
                    "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
                    "mtp.layers.0.input_layernorm.weight", "mtp.layers.0.post_attention_layernorm.weight",
                    "mtp.layers.0.self_attn.q_norm.weight", "mtp.layers.0.self_attn.k_norm.weight",
                    *(f"mtp.layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
                    *(f"mtp.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))}
    assert {n for n in names if n.startswith("mtp.")} == expected_mtp
    assert "model.embed_tokens.weight" in names and "model.norm.weight" in names
    assert "lm_head.weight" not in names  # tied
    assert dict(tree_flatten(tiny_model().parameters()))["mtp.fc.weight"].shape == (64, 128)
