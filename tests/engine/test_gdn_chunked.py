"""The chunked Gated DeltaNet verify and prefill (gdn_chunked.py): equal to mlx-lm's per-token
recurrence to float rounding, rollback of any prefix, and greedy MTP = greedy AR with it on."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, trim_prompt_cache
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk

from mtplxd.engine import GenerationRequest, GenerationResult, SamplingParams, load_model
from mtplxd.engine.fixtures.tiny_hybrid import write_tiny_hybrid_checkpoint
from mtplxd.engine.bench.host import primitives
from mtplxd.engine.model import gdn_chunked
from mtplxd.engine.model.hybrid import HYBRID_MODEL_TYPES
from mtplxd.engine.model.rollback import make_rollback_cache

from mtplxd.engine.model.kv_cache import fixed_shapes_wanted

# float32 throughout; on CUDA the matmuls may round more coarsely (TF32-class), so there the
# check is looser. Bugs (a wrong decay, a missed row) are off by O(1).
TOL = 2e-3 if fixed_shapes_wanted() else 2e-5


def _inputs(T, Hk=2, Hv=4, Dk=16, Dv=8, seed=0):
    keys = iter(mx.random.split(mx.random.key(seed), 8))
    q = mx.random.normal((1, T, Hk, Dk), key=next(keys))
    k = mx.random.normal((1, T, Hk, Dk), key=next(keys))
    q, k = normalize_qk(q, k, inv_scale=Dk ** -0.5, eps=1e-6)
    v = mx.random.normal((1, T, Hv, Dv), key=next(keys))
    a = mx.random.normal((1, T, Hv), key=next(keys))
    b = mx.random.normal((1, T, Hv), key=next(keys))
    A_log = 0.5 * mx.random.normal((Hv,), key=next(keys))
    dt_bias = mx.random.normal((Hv,), key=next(keys))
    state = 0.3 * mx.random.normal((1, Hv, Dv, Dk), key=next(keys))
    return q, k, v, a, b, A_log, dt_bias, state


def _max_error(x, y):
    return mx.max(mx.abs(x.astype(mx.float32) - y.astype(mx.float32))).item()


@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 7, 8, 9, 16])
def test_chunked_delta_equals_the_per_token_recurrence(T):
    q, k, v, a, b, A_log, dt_bias, state = _inputs(T)
    want_y, want_state = gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, None, use_kernel=False)
    y, final, _, _ = gdn_chunked.chunked_delta(q, k, v, gdn_chunked.log_decay(A_log, a, dt_bias),
                                               mx.sigmoid(b), state)
    assert y.shape == want_y.shape and y.dtype == want_y.dtype
    assert final.shape == want_state.shape and final.dtype == mx.float32
    assert _max_error(y, want_y) < TOL
    assert _max_error(final, want_state) < TOL


@pytest.mark.parametrize("T", [2, 5, 7])
def test_state_after_any_prefix_equals_the_recurrence_over_that_prefix(T):
    q, k, v, a, b, A_log, dt_bias, state = _inputs(T, seed=3)
    _, _, u, log_gamma = gdn_chunked.chunked_delta(q, k, v, gdn_chunked.log_decay(A_log, a, dt_bias),
                                                   mx.sigmoid(b), state)
    for keep in range(1, T + 1):
        _, want = gated_delta_update(q[:, :keep], k[:, :keep], v[:, :keep], a[:, :keep], b[:, :keep],
                                     A_log, dt_bias, state, None, use_kernel=False)
        got = gdn_chunked.state_after(state, u, gdn_chunked.heads_first(k, v.shape[2]), log_gamma, keep)
        assert _max_error(got, want) < TOL, keep


def test_a_strongly_decaying_head_stays_finite():
    """Gamma underflows to 0 over a few tokens when the decay is steep; ratios of Gammas are
    taken as exp of differences of logs, so nothing becomes 0/0."""
    q, k, v, a, b, A_log, dt_bias, state = _inputs(7, seed=5)
    a = a + 60.0  # softplus(a + dt) ~ 60: g ~ exp(-60 e^A) per token
    want_y, want_state = gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, None, use_kernel=False)
    y, final, _, _ = gdn_chunked.chunked_delta(q, k, v, gdn_chunked.log_decay(A_log, a, dt_bias),
                                               mx.sigmoid(b), state)
    assert _max_error(y, want_y) < TOL and _max_error(final, want_state) < TOL


@pytest.mark.parametrize("T", [1, 31, 32, 33, 100])
def test_chunked_prefill_equals_the_per_token_recurrence_over_a_long_prompt(T):
    """A prompt goes through `chunked_delta` PREFILL_CHUNK_TOKENS at a time, the state carried
    from chunk to chunk: a whole chunk, one token more or less, several chunks and a short
    tail, with value heads grouped 3 to a key head (GQA)."""
    q, k, v, a, b, A_log, dt_bias, state = _inputs(T, Hk=2, Hv=6, seed=7)
    want_y, want_state = gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, None, use_kernel=False)
    y, final = gdn_chunked.chunked_prefill(q, k, v, gdn_chunked.log_decay(A_log, a, dt_bias),
                                           mx.sigmoid(b), state)
    assert y.shape == want_y.shape and final.shape == want_state.shape and final.dtype == mx.float32
    assert _max_error(y, want_y) < TOL and _max_error(final, want_state) < TOL


def test_a_long_prompt_with_steep_decays_stays_finite():
    """Gamma underflows within a chunk; the prefill takes no ratio of Gammas but as exp of a
    difference of logs, so a steep head still matches the recurrence over several chunks."""
    q, k, v, a, b, A_log, dt_bias, state = _inputs(100, Hk=2, Hv=6, seed=11)
    a = a + mx.array([60.0, 0, 0, 60.0, 0, 0])  # two heads forget within a token
    want_y, want_state = gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, None, use_kernel=False)
    y, final = gdn_chunked.chunked_prefill(q, k, v, gdn_chunked.log_decay(A_log, a, dt_bias),
                                           mx.sigmoid(b), state)
    assert _max_error(y, want_y) < TOL and _max_error(final, want_state) < TOL


def test_a_prompt_chunk_is_solved_in_far_fewer_ops_than_chunk_by_chunk():
    """512 tokens (a prefill chunk): the chunks' own solves at once and a short state loop,
    against `chunked_delta` once per 32 tokens (how chunked_prefill ran up to 2026-12-04),
    with the same values to float rounding."""
    q, k, v, a, b, A_log, dt_bias, state = _inputs(512, Hk=2, Hv=6, seed=9)
    log_g, beta = gdn_chunked.log_decay(A_log, a, dt_bias), mx.sigmoid(b)
    mx.eval(q, k, v, log_g, beta, state)  # so the counts below are the solves' own graphs
    y, final = gdn_chunked.chunked_prefill(q, k, v, log_g, beta, state)
    ys, carried = [], state
    for start in range(0, 512, gdn_chunked.PREFILL_CHUNK_TOKENS):
        rows = slice(start, start + gdn_chunked.PREFILL_CHUNK_TOKENS)
        part, carried, _, _ = gdn_chunked.chunked_delta(q[:, rows], k[:, rows], v[:, rows], log_g[:, rows],
                                                        beta[:, rows], carried)
        ys.append(part)
    chunk_by_chunk = mx.concatenate(ys, axis=1)
    # Counted before anything is evaluated: the graph each builds, views included.
    ops, loop_ops = (sum(primitives(arrays).values()) for arrays in ([y, final], [chunk_by_chunk, carried]))
    assert ops * 4 < loop_ops, (ops, loop_ops)  # 281 against 1,697 when written
    assert _max_error(y, chunk_by_chunk) < TOL and _max_error(final, carried) < TOL


def test_the_verify_is_chunked_on_cuda_only_by_default():
    assert gdn_chunked.active() is fixed_shapes_wanted()
    assert gdn_chunked.path_name() == ("chunked" if fixed_shapes_wanted() else "per-token")


@pytest.fixture
def chunked():
    gdn_chunked.force(True)
    yield
    gdn_chunked.force(None)


@pytest.fixture(scope="module", params=HYBRID_MODEL_TYPES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def checkpoint(family, tmp_path_factory):
    return write_tiny_hybrid_checkpoint(tmp_path_factory.mktemp(family), family, draft_friendly=True)


PROMPT = [5, 17, 42, 99, 3, 250, 7]
VERIFY = [11, 300, 64, 128, 9]


@pytest.mark.parametrize("accepted", range(len(VERIFY)))
def test_rollback_after_a_chunked_verify_equals_a_direct_forward(checkpoint, chunked, accepted):
    from mlx_lm.utils import load_model as mlx_lm_load

    model, _ = mlx_lm_load(checkpoint)

    def run(cache, tokens):
        out = model(mx.array(tokens)[None], cache=cache)
        mx.eval(out, [c.state for c in cache])
        return out

    cache = make_rollback_cache(model)
    run(cache, PROMPT)
    run(cache, VERIFY)
    trimmed = len(VERIFY) - 1 - accepted
    assert trim_prompt_cache(cache, trimmed) == trimmed
    direct = make_rollback_cache(model)
    run(direct, PROMPT)
    run(direct, VERIFY[:accepted + 1])
    for got, want in zip(cache, direct):
        if isinstance(want, ArraysCache):
            assert _max_error(got[0], want[0]) < TOL and _max_error(got[1], want[1]) < TOL
    assert _max_error(run(cache, [77]), run(direct, [77])) < 50 * TOL


def test_greedy_mtp_equals_ar_with_the_chunked_verify(checkpoint, chunked):
    model = load_model(checkpoint)
    ids = model.tokenizer.encode("def add(a, b):\n    return")

    def generate(depth):
        request = GenerationRequest(ids, SamplingParams(temperature=0.0, max_tokens=40), depth=depth)
        return next(x for x in model.generate(request) if isinstance(x, GenerationResult))

    ar = generate(0)
    for depth in (1, 2, 3, 4):
        mtp = generate(depth)
        assert mtp.token_ids == ar.token_ids, depth
        assert mtp.stats.accepted > 0


def test_a_long_prompt_is_prefilled_in_chunks_where_verifies_are(checkpoint, chunked):
    """Past the capture limit (a prompt's 512-token chunks), a GDN layer on the chunked path
    (CUDA's) runs `chunked_prefill`: the same state as mlx-lm's loop over the tokens to float
    rounding, in a fraction of the graph nodes (the host builds and encodes each one, and a
    hybrid's prefill on CUDA is host-bound), and it keeps only the snapshot, as before."""
    from mlx_lm.utils import load_model as mlx_lm_load

    model, _ = mlx_lm_load(checkpoint)
    index = next(i for i, layer in enumerate(model.layers) if getattr(layer, "is_linear", False))
    layer = model.layers[index].linear_attn
    tokens = mx.random.normal((1, 100, layer.hidden_size), key=mx.random.key(2)).astype(mx.bfloat16)
    results = {}
    for on in (False, True):
        gdn_chunked.force(on)
        cache = make_rollback_cache(model)[index]
        out = layer(tokens, None, cache)
        # Views included: the host builds and encodes each primitive.
        results[on] = (out, cache[1], sum(primitives([out, cache[1]]).values()))
        assert cache.capture is not None and not cache.capture.replayable
        cache.restore()  # the snapshot still undoes the whole forward
        assert cache[1] is None
    (want, want_state, loop_nodes), (got, state, chunk_nodes) = results[False], results[True]
    assert _max_error(state, want_state) < TOL and _max_error(got, want) < 0.05
    assert chunk_nodes * 4 < loop_nodes
