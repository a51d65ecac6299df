"""Hybrid Qwen3.5 / Qwen3.5-MoE / Qwen3-Next: checkpoints, MTP loading, head forward, greedy exactness."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.models.cache import KVCache
from mlx_lm.utils import load_model as mlx_lm_load_model

from mtplxd.engine import GenerationRequest, GenerationResult, SamplingParams, inspect_checkpoint, load_model
from mtplxd.engine.fixtures.tiny import write_tiny_checkpoint
from mtplxd.engine.fixtures.tiny_hybrid import write_tiny_hybrid_checkpoint
from mtplxd.engine.model.families import get_family
from mtplxd.engine.model.hybrid import (
    HYBRID_MODEL_TYPES,
    check_layer_types,
    norm_shift,
    sanitize_mtp_weights,
)
from mtplxd.engine.model.mtp_head import is_mtp_norm
from mtplxd.engine.model.rollback import RollbackArraysCache

MTP_NORMS = (
    "mtp.pre_fc_norm_embedding.weight",
    "mtp.pre_fc_norm_hidden.weight",
    "mtp.norm.weight",
    "mtp.layers.0.input_layernorm.weight",
    "mtp.layers.0.post_attention_layernorm.weight",
    "mtp.layers.0.self_attn.q_norm.weight",
    "mtp.layers.0.self_attn.k_norm.weight",
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """factory(family, **kwargs) -> path; one tiny checkpoint per variant for this module.

    Plain random weights unless the test asks for draft_friendly=True: every MTP tensor then
    matters to the head's output, so the loading and reference tests see every mistake.
    """
    made = {}

    def make(family, **kwargs):
        kwargs.setdefault("draft_friendly", False)
        key = json.dumps([family, kwargs], sort_keys=True)
        if key not in made:
            made[key] = write_tiny_hybrid_checkpoint(tmp_path_factory.mktemp(family), family, **kwargs)
        return made[key]

    return make


def _raw(path):
    return mx.load(str(path / "model.safetensors"))


def _text_config(path):
    config = json.loads((path / "config.json").read_text())
    return config.get("text_config", config)


# --- checkpoints -------------------------------------------------------------------------


@pytest.mark.parametrize("family", HYBRID_MODEL_TYPES)
def test_tiny_checkpoint_has_hf_layout_and_the_mtp_tensors(checkpoints, family):
    path = checkpoints(family)
    text = _text_config(path)
    raw = _raw(path)
    check_layer_types(text)
    assert text["layer_types"] == ["linear_attention", "full_attention"] * 2
    body = "model" if family == "qwen3_next" else "model.language_model"
    conv = raw[f"{body}.layers.0.linear_attn.conv1d.weight"]
    assert conv.shape[1:] == (1, text["linear_conv_kernel_dim"])  # PyTorch layout, unconverted
    assert abs(raw[f"{body}.norm.weight"].mean().item()) < 0.2  # zero-centred (1+w) gains
    assert raw["mtp.fc.weight"].shape == (text["hidden_size"], 2 * text["hidden_size"])
    assert raw["mtp.layers.0.self_attn.q_proj.weight"].shape[0] == 2 * text["num_attention_heads"] * text["head_dim"]
    for name in MTP_NORMS:
        assert name in raw
    mtp = [k for k in raw if k.startswith("mtp.")]
    if family == "qwen3_5":
        assert len(mtp) == 15  # engine.md 2.1
    elif family == "qwen3_5_moe":
        assert raw["mtp.layers.0.mlp.experts.gate_up_proj"].shape == (
            text["num_experts"], 2 * text["moe_intermediate_size"], text["hidden_size"])
        assert "mtp.layers.0.mlp.shared_expert_gate.weight" in raw
    else:
        assert "mtp.layers.0.mlp.experts.3.up_proj.weight" in raw
    assert inspect_checkpoint(path).mode == "mtp"


@pytest.mark.parametrize("family", HYBRID_MODEL_TYPES)
def test_checkpoint_without_mtp_tensors_is_served_ar_with_a_reason(checkpoints, family):
    report = inspect_checkpoint(checkpoints(family, with_mtp=False))
    assert report.mode == "ar" and "mtp" in report.reason
    model = load_model(checkpoints(family, with_mtp=False))
    assert model.info.mode == "ar" and model.head is None


def test_layer_types_inconsistent_with_interval_is_rejected():
    text = {"num_hidden_layers": 4, "full_attention_interval": 2,
            "layer_types": ["linear_attention", "linear_attention", "full_attention", "full_attention"]}
    with pytest.raises(ValueError, match="full_attention_interval=2"):
        check_layer_types(text)


def test_same_seed_same_bytes(tmp_path):
    a = write_tiny_hybrid_checkpoint(tmp_path / "a", "qwen3_next", seed=3)
    b = write_tiny_hybrid_checkpoint(tmp_path / "b", "qwen3_next", seed=3)
    c = write_tiny_hybrid_checkpoint(tmp_path / "c", "qwen3_next", seed=4)
    data = [(p / "model.safetensors").read_bytes() for p in (a, b, c)]
    assert data[0] == data[1] != data[2]


def test_tiny_factory_of_the_core_delegates_hybrid_families(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "m", "qwen3_5_moe", num_hidden_layers=2)
    assert _text_config(path)["num_hidden_layers"] == 2
    assert load_model(path).info.mode == "mtp"


# --- loading: MTP kept, converted and norm-shifted -------------------------------------------


@pytest.mark.parametrize("family", HYBRID_MODEL_TYPES)
def test_norm_shift_follows_the_trunk(checkpoints, family):
    assert norm_shift(family, _raw(checkpoints(family)))  # HF layout: trunk norms get +1
    assert not norm_shift(family, _raw(checkpoints(family, quantize_bits=4)))  # converted


@pytest.mark.parametrize("family", HYBRID_MODEL_TYPES)
def test_loader_keeps_mtp_tensors_and_shifts_all_seven_norms(checkpoints, family):
    path = checkpoints(family)
    raw = _raw(path)
    model = load_model(path)
    params = dict(_flatten(model.head.parameters(), "mtp"))
    expected = sanitize_mtp_weights({k: v for k, v in raw.items() if k.startswith("mtp.")})
    assert set(params) == set(expected)
    shifted = [k for k in params if is_mtp_norm(k)]
    assert sorted(shifted) == sorted(MTP_NORMS)
    for name, value in params.items():
        want = expected[name] + 1.0 if name in MTP_NORMS else expected[name]
        assert mx.array_equal(value, want).item(), name
    # The trunk's own norms got the same +1 from mlx-lm's sanitize.
    body = "model" if family == "qwen3_next" else "model.language_model"
    trunk_norm = model.trunk.text.model.norm.weight
    assert mx.array_equal(trunk_norm, raw[f"{body}.norm.weight"] + 1.0).item()


@pytest.mark.parametrize("family", HYBRID_MODEL_TYPES)
def test_quantized_checkpoint_loads_head_quantized_and_unshifted(checkpoints, family):
    path = checkpoints(family, quantize_bits=4)
    raw = _raw(path)
    model = load_model(path, dequantize_weights="off")  # as loaded (the Linux CPU's default dequantizes)
    assert model.info.mode == "mtp" and model.info.quantization == "4bit"
    assert type(model.head.fc).__name__ == "QuantizedLinear"
    for name in MTP_NORMS:  # stored already converted, so loaded as is
        assert mx.array_equal(dict(_flatten(model.head.parameters(), "mtp"))[name], raw[name]).item()


def test_sanitize_mtp_stacks_and_splits_experts():
    E, I, H = 3, 4, 8
    fused = mx.arange(E * 2 * I * H, dtype=mx.float32).reshape(E, 2 * I, H)
    out = sanitize_mtp_weights({"mtp.layers.0.mlp.experts.gate_up_proj": fused,
                                "mtp.layers.0.mlp.experts.down_proj": fused[:, :H, :I]})
    assert mx.array_equal(out["mtp.layers.0.mlp.switch_mlp.gate_proj.weight"], fused[:, :I]).item()
    assert mx.array_equal(out["mtp.layers.0.mlp.switch_mlp.up_proj.weight"], fused[:, I:]).item()
    per = {f"mtp.layers.0.mlp.experts.{e}.up_proj.weight": mx.full((I, H), e) for e in range(E)}
    out = sanitize_mtp_weights(per)
    assert out["mtp.layers.0.mlp.switch_mlp.up_proj.weight"][:, 0, 0].tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="expert indices"):
        sanitize_mtp_weights({"mtp.layers.0.mlp.experts.1.up_proj.weight": mx.zeros((I, H))})


@pytest.mark.parametrize("family", HYBRID_MODEL_TYPES)
def test_family_cache_is_trimmable_with_rollback_for_gdn_layers(checkpoints, family):
    model = load_model(checkpoints(family))
    cache = model.trunk.make_cache()
    kinds = [type(c).__name__ for c in cache]
    assert kinds == ["RollbackArraysCache", "KVCache"] * 2
    assert get_family(family).make_cache is not None


def _flatten(tree, prefix):
    from mlx.utils import tree_flatten

    return [(f"{prefix}.{k}", v) for k, v in tree_flatten(tree)]


# --- the MTP head forward against a hand-written engine.md 2.3 -------------------------------


def _rms(x, w, eps=1e-6):
    x32 = x.astype(mx.float32)
    return x32 * mx.rsqrt(mx.mean(x32 * x32, axis=-1, keepdims=True) + eps) * (1.0 + w)


def _rope(x, positions, dims, base):
    half = dims // 2
    inv = base ** (-mx.arange(0, half, dtype=mx.float32) * 2 / dims)
    angles = positions[:, None].astype(mx.float32) * inv[None, :]  # (L, half)
    cos, sin = mx.cos(angles)[:, None, :], mx.sin(angles)[:, None, :]
    x1, x2, rest = x[..., :half], x[..., half:dims], x[..., dims:]
    return mx.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest], axis=-1)


def _ref_attention(x, W, p, t, positions):
    nh, nkv, hd = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    L = x.shape[0]
    qg = (x @ W[f"{p}.self_attn.q_proj.weight"].T).reshape(L, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(L, nh * hd)
    k = (x @ W[f"{p}.self_attn.k_proj.weight"].T).reshape(L, nkv, hd)
    v = (x @ W[f"{p}.self_attn.v_proj.weight"].T).reshape(L, nkv, hd)
    q = _rms(q, W[f"{p}.self_attn.q_norm.weight"])
    k = _rms(k, W[f"{p}.self_attn.k_norm.weight"])
    rope = t.get("rope_parameters") or {}
    base = rope.get("rope_theta", t.get("rope_theta"))
    dims = int(hd * rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 1.0)))
    q, k = _rope(q, positions, dims, base), _rope(k, positions, dims, base)
    out = []
    for h in range(nh):
        kv = h // (nh // nkv)
        scores = (q[:, h] @ k[:, kv].T) * hd**-0.5
        scores = mx.where(mx.tril(mx.ones((L, L))) > 0, scores, -math.inf)
        out.append(mx.softmax(scores, axis=-1) @ v[:, kv])
    o = mx.stack(out, axis=1).reshape(L, nh * hd) * mx.sigmoid(gate)
    return o @ W[f"{p}.self_attn.o_proj.weight"].T


def _ref_glu(x, gate, up, down):
    g = x @ gate.T
    return (g * mx.sigmoid(g) * (x @ up.T)) @ down.T


def _ref_mlp(x, W, p, t, family):
    m = f"{p}.mlp"
    if family == "qwen3_5":
        return _ref_glu(x, W[f"{m}.gate_proj.weight"], W[f"{m}.up_proj.weight"], W[f"{m}.down_proj.weight"])
    E, k, I = t["num_experts"], t["num_experts_per_tok"], t["moe_intermediate_size"]
    if family == "qwen3_5_moe":
        gu, dn = W[f"{m}.experts.gate_up_proj"], W[f"{m}.experts.down_proj"]
        experts = [(gu[e, :I], gu[e, I:], dn[e]) for e in range(E)]
    else:
        experts = [tuple(W[f"{m}.experts.{e}.{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj"))
                   for e in range(E)]
    probs = mx.softmax(x @ W[f"{m}.gate.weight"].T, axis=-1)
    rows = []
    for r in range(x.shape[0]):
        top = sorted(range(E), key=lambda e: -probs[r, e].item())[:k]
        weights = [probs[r, e] for e in top]
        total = sum(weights)
        y = sum((w / total) * _ref_glu(x[r:r + 1], *experts[e]) for w, e in zip(weights, top))
        rows.append(y)
    shared = _ref_glu(x, W[f"{m}.shared_expert.gate_proj.weight"], W[f"{m}.shared_expert.up_proj.weight"],
                      W[f"{m}.shared_expert.down_proj.weight"])
    return mx.concatenate(rows, axis=0) + mx.sigmoid(x @ W[f"{m}.shared_expert_gate.weight"].T) * shared


def _ref_mtp_step(W, t, family, embed, lm_head, h, tokens, x_prev):
    """engine.md 2.3 over raw HF tensors: returns (g rows for `tokens`, fc outputs so far)."""
    e = _rms(embed[mx.array(tokens)], W["mtp.pre_fc_norm_embedding.weight"])
    hn = _rms(h, W["mtp.pre_fc_norm_hidden.weight"])
    x = mx.concatenate([e, hn], axis=-1) @ W["mtp.fc.weight"].T  # embedding FIRST
    xs = x if x_prev is None else mx.concatenate([x_prev, x], axis=0)
    positions = mx.arange(xs.shape[0])
    p = "mtp.layers.0"
    r = xs + _ref_attention(_rms(xs, W[f"{p}.input_layernorm.weight"]), W, p, t, positions)
    out = r + _ref_mlp(_rms(r, W[f"{p}.post_attention_layernorm.weight"]), W, p, t, family)
    g = _rms(out[-x.shape[0]:], W["mtp.norm.weight"])
    return g, xs


@pytest.mark.parametrize("family", HYBRID_MODEL_TYPES)
def test_mtp_head_forward_matches_hand_written_reference(checkpoints, family):
    path = checkpoints(family)
    W, t = _raw(path), _text_config(path)
    model = load_model(path)
    trunk, head = model.trunk, model.head
    body = "model" if family == "qwen3_next" else "model.language_model"
    embed, lm_head = W[f"{body}.embed_tokens.weight"], W["lm_head.weight"]

    prompt = [12, 250, 7, 99, 31, 4]
    hidden, logits = trunk.forward(mx.array(prompt)[None], trunk.make_cache(), all_logits=True)
    # h_t is the trunk's post-final-norm hidden: the lm_head input.
    assert mx.allclose(hidden[0] @ lm_head.T, logits[0], atol=1e-4).item()

    nxt = [int(mx.argmax(logits[0, -1]).item())]
    pending_tokens = prompt[1:] + nxt  # pairs (h_j, x_{j+1}) at positions 0..L-1
    cache = head.make_cache()
    g = head(hidden, trunk.embed(mx.array(pending_tokens)[None]), cache)
    ref_g, xs = _ref_mtp_step(W, t, family, embed, lm_head, hidden[0], pending_tokens, None)
    assert mx.allclose(g[0], ref_g, atol=2e-4, rtol=1e-4).item()
    d1 = int(mx.argmax(trunk.lm_head(g[:, -1:])).item())
    assert d1 == int(mx.argmax(ref_g[-1] @ lm_head.T).item())

    # Depth 2: the normed output g is fed back as h, with the draft token, one position on.
    g2 = head(g[:, -1:], trunk.embed(mx.array([[d1]])), cache)
    ref_g2, _ = _ref_mtp_step(W, t, family, embed, lm_head, ref_g[-1:], [d1], xs)
    assert cache[0].offset == len(pending_tokens) + 1
    assert mx.allclose(g2[0], ref_g2, atol=2e-4, rtol=1e-4).item()


# --- greedy exactness: MTP output == AR output, token for token ------------------------------

PROMPTS = (
    "def add(a, b):\n    ret",  # ends mid-word
    "the model reads a fi",  # ends mid-word
    "x",
    "import json\nwith open(path) as f:\n    data = json.load(f)\n" * 12,  # past the capture limit
)


def _generate(model, ids, depth, max_tokens=40):
    request = GenerationRequest(list(ids), SamplingParams(temperature=0.0, max_tokens=max_tokens), depth=depth)
    return next(x for x in model.generate(request) if isinstance(x, GenerationResult))


@pytest.mark.parametrize("family", HYBRID_MODEL_TYPES)
def test_greedy_mtp_equals_ar_for_hybrid_family_depths_1_to_4(checkpoints, family):
    model = load_model(checkpoints(family, draft_friendly=True))
    accepted_full = 0
    for prompt in PROMPTS:
        ids = model.tokenizer.encode(prompt)
        ar = _generate(model, ids, 0)
        assert ar.stats.depth == 0
        for depth in (1, 2, 3, 4):
            mtp = _generate(model, ids, depth)
            assert mtp.token_ids == ar.token_ids, (prompt, depth)
            assert mtp.text == ar.text
            accepted_full += mtp.stats.accepted_by_depth[-1]
            assert 0 < mtp.stats.accepted < mtp.stats.drafted  # partial accepts happened
    assert accepted_full > 0  # and full accepts (bonus token path)


@pytest.mark.parametrize("family", HYBRID_MODEL_TYPES)
def test_greedy_mtp_equals_ar_quantized_bf16_and_tied(checkpoints, family):
    variants = [{"quantize_bits": 4}, {"quantize_bits": 8}]
    if family == "qwen3_5":  # MLX's CPU GatherMM (MoE experts) runs float32 only
        variants.append({"torch_dtype": "bfloat16"})
    # Tied embeddings (lm_head = embed_tokens.as_linear); plain random weights, since a
    # draft-friendly tied model just repeats one token.
    variants.append({"tie_word_embeddings": True, "draft_friendly": False})
    for kwargs in variants:
        model = load_model(checkpoints(family, **{"draft_friendly": True, **kwargs}))
        ids = model.tokenizer.encode(PROMPTS[0])
        ar = _generate(model, ids, 0, max_tokens=32)
        assert len(set(ar.token_ids)) > 3
        for depth in (2, 4):
            mtp = _generate(model, ids, depth, max_tokens=32)
            assert mtp.token_ids == ar.token_ids, (kwargs, depth)
            if kwargs.get("draft_friendly", True):
                assert mtp.stats.accepted > 0


@pytest.mark.parametrize("family", HYBRID_MODEL_TYPES)
def test_mlx_lm_speculative_generate_runs_unchanged_on_the_rollback_cache(checkpoints, family, tmp_path):
    """Independent cross-check: mlx-lm's own speculative loop (draft model = a dense qwen3) with
    our hybrid cache gives mlx-lm's own greedy output."""
    target, _ = mlx_lm_load_model(checkpoints(family, draft_friendly=True))
    draft, _ = mlx_lm_load_model(write_tiny_checkpoint(tmp_path / "draft", "qwen3", with_mtp=False))
    prompt = mx.array([5, 17, 42, 99, 3, 250, 7, 11])
    want = [int(t) for t, _ in zip((t for t, _ in generate_step(prompt, target, max_tokens=24)), range(24))]
    cache = get_family(family).make_cache(target) + [KVCache() for _ in draft.layers]
    got = [int(t) for t, _, _ in speculative_generate_step(
        prompt, target, draft, num_draft_tokens=3, prompt_cache=cache, max_tokens=24)]
    assert got == want
    assert any(isinstance(c, RollbackArraysCache) for c in cache)


@pytest.mark.parametrize("family", HYBRID_MODEL_TYPES)
def test_greedy_mtp_equals_ar_with_penalties(checkpoints, family):
    model = load_model(checkpoints(family, draft_friendly=True))
    ids = model.tokenizer.encode(PROMPTS[1])
    params = dict(temperature=0.0, max_tokens=32, repetition_penalty=1.3, presence_penalty=0.5)
    runs = {}
    for depth in (0, 3):
        request = GenerationRequest(list(ids), SamplingParams(**params), depth=depth)
        runs[depth] = next(x for x in model.generate(request) if isinstance(x, GenerationResult))
    assert runs[3].token_ids == runs[0].token_ids
    assert runs[3].stats.accepted > 0


@pytest.mark.parametrize("family", HYBRID_MODEL_TYPES)
def test_sampled_mtp_same_seed_same_output(checkpoints, family):
    model = load_model(checkpoints(family, draft_friendly=True))
    ids = model.tokenizer.encode(PROMPTS[0])

    def sample(seed):
        params = SamplingParams(temperature=0.8, top_p=0.95, seed=seed, max_tokens=32)
        return next(x for x in model.generate(GenerationRequest(list(ids), params, depth=3))
                    if isinstance(x, GenerationResult))

    first, again, other = sample(7), sample(7), sample(8)
    assert first.token_ids == again.token_ids
    assert first.token_ids != other.token_ids
    assert first.stats.accepted > 0


@pytest.mark.parametrize("family", HYBRID_MODEL_TYPES)
def test_score_on_hybrid_model(checkpoints, family):
    model = load_model(checkpoints(family))
    ids = model.tokenizer.encode(PROMPTS[0])
    scores = model.score(ids)
    assert scores[0] is None and len(scores) == len(ids)
    assert all(s <= 0.0 for s in scores[1:])


def test_checkpoint_with_non_periodic_layer_types_is_refused(checkpoints, tmp_path):
    import shutil

    from mtplxd.engine import ModelLoadError

    path = shutil.copytree(checkpoints("qwen3_5"), tmp_path / "bad")
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["layer_types"] = ["full_attention"] + ["linear_attention"] * 3
    (path / "config.json").write_text(json.dumps(config))
    report = inspect_checkpoint(path)
    assert report.mode == "refused" and "layer_types" in report.reason
    with pytest.raises(ModelLoadError, match="layer_types"):
        load_model(path)
