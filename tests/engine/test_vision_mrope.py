"""Image rows at Qwen-VL's multimodal (t, h, w) rotary positions (mRoPE), on the tiny random
vision checkpoint: our trunk and tower give the logits mlx-vlm's own full model gives on the
same weights and pixels, for the prompt and for tokens decoded after it; a session-bank restore
continues at the same positions as a cold run."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from mtplxd.engine import GenerationRequest, SamplingParams, load_model
from mtplxd.engine.fixtures.tiny_vision import write_tiny_vision_checkpoint
from mtplxd.engine.model import mrope
from mtplxd.engine.model.vision import expand_placeholders, placeholder_runs
from mtplxd.engine.session.bank import BankSettings
from support.images import png


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = write_tiny_vision_checkpoint(tmp_path_factory.mktemp("mrope") / "tiny-vl")
    processor = json.loads((path / "preprocessor_config.json").read_text())
    processor["size"]["longest_edge"] = 96 * 64  # room for a 2 x 3 merged grid (h != w)
    (path / "preprocessor_config.json").write_text(json.dumps(processor))
    return path


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(checkpoint)


def image_prompt(model, image: bytes, before: str = "look at this", after: str = "and say more"):
    """A prompt with text before and after one image (so text continues past the image rows)."""
    content = [{"type": "text", "text": before}, {"type": "image"}, {"type": "text", "text": after}]
    text = model.tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                               add_generation_prompt=True, tokenize=False)
    images = [model.vision.prepare(image)]
    ids = list(model.tokenizer.encode(text, add_special_tokens=False))
    return expand_placeholders(ids, model.vision.image_token_id, images), images


def our_logits(model, prompt, images, extra: list[int], chunk: int) -> mx.array:
    """Logits of every prompt row (prefilled in `chunk`-token pieces, as the engine does) and
    of `extra` tokens decoded one at a time after it."""
    trunk = model.trunk
    embeddings = model.vision.embed_prompt(trunk.input_embedding, prompt, images)
    cache = trunk.make_cache()
    mrope.attach(cache, model.vision.row_positions(prompt, images))
    rows = []
    for start in range(0, len(prompt), chunk):
        tokens = mx.array(prompt[start:start + chunk])[None]
        rows.append(trunk.forward(tokens, cache, all_logits=True,
                                  embeddings=embeddings[:, start:start + chunk])[1])
    for token in extra:
        rows.append(trunk.forward(mx.array([[token]]), cache, all_logits=True)[1])
    return mx.concatenate(rows, axis=1)


def test_trunk_logits_for_an_image_prompt_equal_mlx_vlms_own_model(model, checkpoint):
    from mlx_vlm.utils import load_model as load_vlm

    reference_model = load_vlm(checkpoint)
    prompt, images = image_prompt(model, png(1, 96, 64))
    [(start, count)] = placeholder_runs(prompt, model.vision.image_token_id)
    assert images[0].grid_thw == (1, 4, 6) and count == 6  # 2 x 3 merged patches: h != w
    extra = [7, 11, 13]  # decoded after the prompt: 1-D positions index + rope_delta
    reference = reference_model(mx.array(prompt + extra)[None],
                                pixel_values=mx.array(images[0].pixel_values),
                                image_grid_thw=mx.array([list(images[0].grid_thw)])).logits
    for chunk in (5, 512):  # chunks that split the image rows, and one whole-prompt forward
        ours = our_logits(model, prompt, images, extra, chunk)
        assert ours.shape == reference.shape
        gap = mx.abs(ours.astype(mx.float32) - reference.astype(mx.float32)).max().item()
        assert gap < 1e-4, f"chunk {chunk}: logits differ from mlx-vlm's by {gap}"


def test_row_positions_are_mlx_vlms_and_continue_at_index_plus_rope_delta(model):
    prompt, images = image_prompt(model, png(1, 96, 64))
    row = model.vision.row_positions(prompt, images)
    [(start, count)] = placeholder_runs(prompt, model.vision.image_token_id)
    # 1 x 2 x 3 merged grid at (t, h, w) offset by the text before it; text resumes at max + 1.
    image_run = next(run for run in row.runs if run.grid is not None)
    assert (image_run.start, image_run.end) == (start, start + count)
    assert image_run.grid[:, 0].tolist() == [[start] * 6, [start] * 3 + [start + 1] * 3,
                                             [start, start + 1, start + 2] * 2]
    assert row.rope_delta == (start + 3) - (start + count)  # next position - next index
    assert row.delta_at(start - 1) == 0 and row.delta_at(start) is None
    assert row.delta_at(len(prompt) + 100) == row.rope_delta


def test_a_text_only_request_on_a_vision_model_keeps_the_1d_rope(model):
    trunk = model.trunk
    ids = mx.array([[3, 5, 7, 9, 11]])
    cache = trunk.make_cache()
    _, logits = trunk.forward(ids, cache, all_logits=True)
    attention = mrope.attention_layers(trunk.text, model.head)[0]
    assert isinstance(attention.rope, mrope.PositionedRoPE) and attention.rope.row is None
    base = attention.rope.base
    x = mx.random.normal((1, 2, 5, 16))
    assert mx.array_equal(attention.rope(x, offset=4), base(x, offset=4))


def run(model, prompt, images, **sampling):
    return model.complete(GenerationRequest(
        prompt_ids=prompt, images=images, depth=3, prefill_chunk=8,
        sampling=SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.0, seed=11,
                                **sampling)))


@pytest.mark.parametrize("tier", ["ram", "ssd"])
def test_a_restored_image_prefix_continues_at_the_cold_runs_positions(model, tmp_path, tier):
    """Turn 2 resends turn 1's transcript (image included) plus its reply and a new question:
    restored from the bank, it equals its own cold run token for token, and the stored entry
    carries the prompt's rope_delta."""
    transcript = "the model reads a file and writes code for the user while tests run fast " * 4
    prompt1, images = image_prompt(model, png(3, 96, 64), transcript)
    settings = BankSettings(ssd_dir=tmp_path, ssd_min_tokens=8) if tier == "ssd" else None
    bank = model.enable_session_bank(settings)
    try:
        first = run(model, prompt1, images)
        [entry] = bank.entries()
        assert entry.rope_delta == model.vision.row_positions(prompt1, images).rope_delta < 0
        if tier == "ssd":  # a restart: RAM empty, the entry only on SSD
            assert bank.store.flush()
            bank.close()
            bank = model.enable_session_bank(settings)
        prompt2 = prompt1 + first.token_ids + model.tokenizer.encode(" and now?", add_special_tokens=False)
        warm = run(model, prompt2, images)
        assert warm.stats.cached_tokens >= len(prompt1)
        assert warm.stats.restored_from == tier
    finally:
        bank.close()
        model.bank = None
    cold = run(model, prompt2, images)
    assert cold.stats.cached_tokens == 0
    assert warm.token_ids == cold.token_ids


@pytest.mark.parametrize("numerics", ["throughput", "exact"])
def test_image_rows_in_one_cohort_each_equal_their_solo_greedy_ar_output(model, numerics):
    """Rows with different images (so different rope deltas) and a text-only row verify in one
    batched forward; each row's attention reads its own positions."""
    from mtplxd.engine.scheduler import Row, Scheduler
    from support.rows import Collector, assert_each_row_equals, run_until_idle

    prompts = [image_prompt(model, png(seed, width, height), "see") for seed, width, height in
               ((4, 96, 64), (5, 64, 64), (6, 64, 96))]
    text_only = model.tokenizer.encode("def add(a, b):\n    ret")
    requests = [GenerationRequest(prompt, SamplingParams(max_tokens=24, ignore_eos=True),
                                  images=images, depth=3) for prompt, images in prompts]
    requests.append(GenerationRequest(text_only, SamplingParams(max_tokens=24, ignore_eos=True),
                                      depth=3))
    assert len({model.vision.row_positions(r.prompt_ids, r.images).rope_delta
                for r in requests[:3]}) > 1
    references = [model.complete(GenerationRequest(list(r.prompt_ids), r.sampling, images=r.images,
                                                   depth=0)) for r in requests]
    scheduler = Scheduler(cohort_mode="always", max_concurrent=4, numerics=numerics)
    sinks = []
    for i, request in enumerate(requests):
        sinks.append(Collector(f"r{i}", []))
        scheduler.submit(Row(request, lambda stop, cohort, request=request: model.generate_steps(
            request, stop, cohort=cohort), sinks[-1], cohort_capable=True))
    run_until_idle(scheduler)
    assert_each_row_equals(sinks, references, [3] * 4)
    assert any(w > 1 and n for w, n in scheduler.status()["cohorts_by_width"].items())


def test_the_bank_identity_changes_with_the_image_processor_settings(tmp_path):
    """Its pixel limits set an image's grid, so its rows and their positions: an SSD entry
    made under other limits must not be restored."""
    from mtplxd.engine.session.bank import weights_fingerprint

    path = write_tiny_vision_checkpoint(tmp_path / "tiny-vl")
    before = weights_fingerprint(path)
    processor = json.loads((path / "preprocessor_config.json").read_text())
    processor["size"]["longest_edge"] = 32 * 32
    (path / "preprocessor_config.json").write_text(json.dumps(processor))
    assert weights_fingerprint(path) != before


def test_logprobs_of_an_image_request_score_the_distribution_it_sampled_from(model):
    """The scorer prefills the prompt with its image rows at their positions: each greedy
    token is its row's best alternative, and every logprob is the full forward's."""
    from mtplxd.engine import TokenDelta

    prompt, images = image_prompt(model, png(1, 96, 64))
    request = GenerationRequest(prompt, SamplingParams(max_tokens=6, ignore_eos=True),
                                images=images, depth=3, logprobs=1)
    scored = [entry for item in model.generate(request) if isinstance(item, TokenDelta)
              for entry in item.logprobs or []]
    tokens = [entry.token for entry in scored]
    assert len(tokens) == 6 and all(entry.top[0][0] == entry.token for entry in scored)
    logits = our_logits(model, prompt, images, tokens[:-1], chunk=512)[0, len(prompt) - 1:]
    expected = (logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    expected = mx.take_along_axis(expected, mx.array(tokens)[:, None], axis=-1)[:, 0].tolist()
    assert [entry.logprob for entry in scored] == pytest.approx(expected, abs=1e-5)
