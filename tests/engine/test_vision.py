"""Images in the prompt on a tiny random vision checkpoint (the hybrid qwen3_5 family with a
vision tower built by mlx-vlm): greedy MTP equals greedy AR with an image in the prompt, and
the session bank (RAM and SSD) keys image rows by the image bytes."""

from __future__ import annotations

import io
import json

import pytest
from PIL import Image

from mtplxd.engine import GenerationRequest, SamplingParams, load_model
from mtplxd.engine.fixtures.tiny_vision import write_tiny_vision_checkpoint
from mtplxd.engine.session.bank import BankSettings
from mtplxd.engine.model.vision import ImageError, expand_placeholders, placeholder_runs
from support.images import png


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(write_tiny_vision_checkpoint(tmp_path_factory.mktemp("vision") / "tiny-vl"))


def prompt_with(model, image: bytes, before: str = "look at this picture and describe it"
                ) -> tuple[list[int], list]:
    # The image closes the user turn: a random tiny model's reply depends most on its last rows.
    messages = [{"role": "user", "content": [{"type": "text", "text": before}, {"type": "image"}]}]
    text = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prepared = [model.vision.prepare(image)]
    ids = list(model.tokenizer.encode(text, add_special_tokens=False))
    return expand_placeholders(ids, model.vision.image_token_id, prepared), prepared


def run(model, prompt, images, *, depth, temperature=0.0, seed=None, max_tokens=24):
    return model.complete(GenerationRequest(
        prompt_ids=prompt, images=images, depth=depth, prefill_chunk=8,
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=temperature,
                                seed=seed)))


def test_the_checkpoint_is_served_mtp_with_its_vision_tower(model):
    assert model.info.mode == "mtp" and model.info.vision and model.info.vision_reason is None
    prompt, images = prompt_with(model, png(1))
    [(start, count)] = placeholder_runs(prompt, model.vision.image_token_id)
    assert count == images[0].tokens == 4  # 64x64 px: 4x4 patches of 16 px, merged 2x2


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_greedy_mtp_equals_greedy_ar_with_an_image_in_the_prompt(model, depth):
    prompt, images = prompt_with(model, png(1))
    ar = run(model, prompt, images, depth=0)
    mtp = run(model, prompt, images, depth=depth)
    assert mtp.token_ids == ar.token_ids
    assert mtp.stats.drafted > 0 and mtp.stats.accepted > 0


def test_greedy_mtp_equals_greedy_ar_with_an_image_for_the_moe_family(tmp_path):
    moe = load_model(write_tiny_vision_checkpoint(tmp_path / "tiny-vl-moe", "qwen3_5_moe"))
    assert moe.info.vision and moe.info.mode == "mtp"
    prompt, images = prompt_with(moe, png(1))
    assert run(moe, prompt, images, depth=3).token_ids == run(moe, prompt, images, depth=0).token_ids


def test_the_image_changes_the_reply(model):
    # Sampled with equal seeds: the tiny greedy model's argmax is dominated by the current
    # token, but its distribution depends on the pixels (a few percent of its mass for this
    # random tower), so some seed among a handful samples a different reply.
    first, images1 = prompt_with(model, png(1))
    second, images2 = prompt_with(model, png(2))
    assert first == second  # same placeholder ids: only the pixels differ
    assert any(run(model, first, images1, depth=3, temperature=1.0, seed=seed).token_ids
               != run(model, second, images2, depth=3, temperature=1.0, seed=seed).token_ids
               for seed in range(5, 13))


def test_a_prompt_whose_placeholders_do_not_match_its_images_is_refused(model):
    prompt, images = prompt_with(model, png(1))
    with pytest.raises(ImageError):
        run(model, prompt[:-3] + [model.vision.image_token_id] + prompt[-3:], images, depth=0)


@pytest.mark.parametrize("tier", ["ram", "ssd"])
def test_bank_keys_image_rows_by_the_image_bytes(model, tmp_path, tier):
    """Same transcript, two different images: the second reply equals its own cold run token
    for token and never restores past the first image row; the same image again restores
    the whole prefix."""
    transcript = "the model reads a file and writes code for the user while tests run fast " * 4
    prompt1, images1 = prompt_with(model, png(1), transcript)  # past the SSD tier's 64-token lead
    prompt2, images2 = prompt_with(model, png(2), transcript)
    [(image_start, _)] = placeholder_runs(prompt1, model.vision.image_token_id)
    sampled = dict(depth=3, temperature=1.0, seed=11)
    cold2 = run(model, prompt2, images2, **sampled)
    settings = BankSettings(ssd_dir=tmp_path, ssd_min_tokens=8) if tier == "ssd" else None
    bank = model.enable_session_bank(settings)
    try:
        run(model, prompt1, images1, **sampled)
        if tier == "ssd":  # a restart: RAM empty, the entry only on SSD
            assert bank.store.flush()
            bank.close()
            bank = model.enable_session_bank(settings)
        warm2 = run(model, prompt2, images2, **sampled)
        assert warm2.token_ids == cold2.token_ids
        assert warm2.stats.cached_tokens <= image_start
        again = run(model, prompt1, images1, **sampled)
        assert again.stats.cached_tokens >= len(prompt1) - 1  # hybrid: all but the last token
    finally:
        bank.close()
        model.bank = None


def test_an_image_that_would_decode_to_too_many_pixels_is_refused_before_decoding(model):
    out = io.BytesIO()
    Image.new("1", (9000, 9000)).save(out, format="PNG")  # ~10 KB on disk, 81 M pixels
    with pytest.raises(ImageError, match="pixels"):
        model.vision.prepare(out.getvalue())
    with pytest.raises(ImageError, match="decoded"):
        model.vision.prepare(b"GIF89a not really")


def test_a_tower_that_does_not_load_leaves_the_text_served_and_says_why(tmp_path):
    path = write_tiny_vision_checkpoint(tmp_path / "tiny-vl-broken")
    config = json.loads((path / "config.json").read_text())
    config["vision_config"]["hidden_size"] = 48  # the stored tower is 32 wide
    (path / "config.json").write_text(json.dumps(config))
    broken = load_model(path)
    assert broken.vision is None and not broken.info.vision
    assert "vision tower did not load" in broken.info.vision_reason
    assert broken.info.mode == "mtp"  # the text model is served as before


def test_a_quantized_tower_from_an_mlx_vlm_conversion_loads(tmp_path):
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    path = write_tiny_vision_checkpoint(tmp_path / "tiny-vl-q8")
    float_model = load_model(path)
    tower = float_model.vision.model
    nn.quantize(tower, group_size=32, bits=8, class_predicate=lambda p, m: isinstance(m, nn.Linear))
    tensors = {k: v for k, v in mx.load(str(path / "model.safetensors")).items()
               if not k.startswith("model.visual.")}
    for name, value in tree_flatten(tower.parameters()):
        if name == "patch_embed.proj.weight":
            value = value.transpose(0, 4, 1, 2, 3)
        tensors[f"model.visual.{name}"] = value
    mx.save_safetensors(str(path / "model.safetensors"), tensors, metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 8}  # what mlx-vlm's converter writes
    (path / "config.json").write_text(json.dumps(config))
    quantized = load_model(path)
    assert quantized.info.vision and hasattr(quantized.vision.model.merger.linear_fc1, "scales")
    prompt, images = prompt_with(quantized, png(1))
    assert run(quantized, prompt, images, depth=3).token_ids == run(quantized, prompt, images, depth=0).token_ids
