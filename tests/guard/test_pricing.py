"""The memory plan against numbers computed by hand from each family's geometry."""

from __future__ import annotations

import pytest

from mtplxd.guard import (
    GIB, InsufficientMemory, MemoryGuard, context_window, plan_for_config, resolve_limit,
)

QWEN3_4B = {  # Qwen3-4B: 36 layers, 8 kv heads of 128, bf16
    "model_type": "qwen3", "hidden_size": 2560, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "intermediate_size": 9728, "max_position_embeddings": 40960, "torch_dtype": "bfloat16",
    "mtp_num_hidden_layers": 1,
}
QWEN35_27B = {  # Qwen3.5-27B geometry from the reference notes (48 GDN + 16 attention layers)
    "model_type": "qwen3_5",
    "text_config": {
        "hidden_size": 5120, "num_hidden_layers": 64, "full_attention_interval": 4,
        "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "intermediate_size": 17408,
        "max_position_embeddings": 262144, "torch_dtype": "bfloat16", "mtp_num_hidden_layers": 1,
    },
}
QWEN3_NEXT = {  # Qwen3-Next-80B-A3B: explicit layer_types, 36 GDN + 12 attention layers
    "model_type": "qwen3_next", "hidden_size": 2048, "num_hidden_layers": 48,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 12,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "moe_intermediate_size": 512,
    "max_position_embeddings": 262144, "torch_dtype": "bfloat16", "num_nextn_predict_layers": 1,
}


def test_dense_qwen3_kv_per_token_by_hand():
    plan = plan_for_config(QWEN3_4B, weights_bytes=8 * GIB)
    # 36 layers x 8 kv heads x 128 dims x (K and V) x 2 bytes = 147456 bytes per token
    assert plan.kv_bytes_per_token == 36 * 8 * 128 * 2 * 2 == 147_456
    assert plan.mtp_kv_bytes_per_token == 8 * 128 * 2 * 2 == 4_096
    assert plan.recurrent_bytes_per_sequence == 0
    assert (plan.attention_layers, plan.recurrent_layers) == (36, 0)


def test_hybrid_qwen35_counts_only_attention_layers_for_kv_and_prices_gdn_state():
    plan = plan_for_config(QWEN35_27B, weights_bytes=16 * GIB)
    assert (plan.attention_layers, plan.recurrent_layers) == (16, 48)
    assert plan.kv_bytes_per_token == 16 * 4 * 256 * 2 * 2 == 65_536
    # Per GDN layer: fp32 state 48 x 128 x 128 x 4 = 3 MiB, plus conv state 3 x conv_dim x 2,
    # conv_dim = 2 x 16 x 128 + 48 x 128 = 10240.
    per_layer = 48 * 128 * 128 * 4 + 3 * 10240 * 2
    assert plan.recurrent_bytes_per_sequence == 48 * per_layer
    # The notes give 144 MiB of recurrent state per sequence; the conv state adds 48 x 60 KiB.
    assert plan.recurrent_bytes_per_sequence // (1024 * 1024) == 146


def test_qwen3_next_reads_layer_types():
    plan = plan_for_config(QWEN3_NEXT, weights_bytes=40 * GIB)
    assert (plan.attention_layers, plan.recurrent_layers) == (12, 36)
    assert plan.kv_bytes_per_token == 12 * 2 * 256 * 2 * 2
    assert plan.mtp_kv_bytes_per_token == 2 * 256 * 2 * 2
    assert plan.recurrent_bytes_per_sequence == 36 * (32 * 128 * 128 * 4 + 3 * (2 * 16 * 128 + 32 * 128) * 2)


def test_request_price_rounds_kv_up_to_the_allocation_step():
    plan = plan_for_config(QWEN3_4B, weights_bytes=8 * GIB)
    small = plan.request_bytes(prompt_tokens=10, max_tokens=10, prefill_chunk=512)
    assert small == 256 * (147_456 + 4_096) + 10 * plan.activation_bytes_per_prefill_token
    assert plan.request_bytes(200, 56, 512) < plan.request_bytes(200, 57, 512)


def test_guard_releases_the_bank_then_shrinks_the_chunk_then_refuses():
    plan = plan_for_config(QWEN3_4B, weights_bytes=8 * GIB)
    bank = {"bytes": 2 * GIB}
    released = []

    def release(needed: int) -> int:
        released.append(needed)
        freed, bank["bytes"] = bank["bytes"], 0
        return freed

    guard = MemoryGuard(plan, limit_bytes=10 * GIB, bank_bytes=lambda: bank["bytes"], release_bank=release,
                        serial=False)
    # 1.5 GiB of KV does not fit next to 8 GiB weights + 2 GiB bank, fits once the bank is gone.
    tokens = int(1.5 * GIB // (147_456 + 4_096))
    first = guard.admit(tokens - 512, 256)
    assert released and bank["bytes"] == 0
    assert guard.held_bytes() == first.bytes
    with pytest.raises(InsufficientMemory) as refused:
        guard.admit(tokens, 256)
    body = refused.value.to_dict()
    assert body["type"] == "insufficient_memory"
    assert body["needed_bytes"] > body["available_bytes"]
    assert body["held_by"]["running_requests"] == first.bytes
    assert "memory_limit" in body["hint"]
    first.release()
    assert guard.held_bytes() == 0
    assert guard.admit(tokens - 512, 256).bytes > 0


def test_serial_guard_does_not_stack_requests_that_run_one_after_another():
    plan = plan_for_config(QWEN3_4B, weights_bytes=8 * GIB)
    guard = MemoryGuard(plan, limit_bytes=10 * GIB)
    tokens = int(1.5 * GIB // (147_456 + 4_096))
    running = guard.admit(tokens, 0)
    queued = guard.admit(tokens, 0)  # runs after `running`: never beside it
    assert guard.holders()["running_requests"] == running.bytes + queued.bytes
    with pytest.raises(InsufficientMemory):
        guard.admit(3 * tokens, 0)  # does not fit even alone


def test_serial_guard_counts_what_the_os_has_left():
    plan = plan_for_config(QWEN3_4B, weights_bytes=1 * GIB)
    free = {"bytes": 64 * GIB}
    guard = MemoryGuard(plan, limit_bytes=32 * GIB, system_available=lambda: free["bytes"])
    first = guard.admit(4096, 0)
    free["bytes"] = first.bytes // 2  # another app took the rest
    second = guard.admit(4096, 0)  # the running request's memory comes back before this one runs
    first.release()
    second.release()
    with pytest.raises(InsufficientMemory):
        guard.admit(4096, 0)


def test_guard_lowers_the_prefill_chunk_when_only_that_fits():
    plan = plan_for_config(QWEN3_4B, weights_bytes=1 * GIB)
    kv = plan.request_bytes(1000, 0, 1) - plan.activation_bytes_per_prefill_token
    limit = plan.weights_bytes + kv + 100 * plan.activation_bytes_per_prefill_token
    guard = MemoryGuard(plan, limit_bytes=limit)
    reservation = guard.admit(1000, 0)
    assert reservation.prefill_chunk == 64


def test_advertised_context_is_what_fits_under_the_limit():
    plan = plan_for_config(QWEN3_4B, weights_bytes=8 * GIB)
    guard = MemoryGuard(plan, limit_bytes=9 * GIB)
    fits = guard.max_context_tokens()
    assert 0 < fits < plan.context_length
    assert fits % 256 == 0
    assert guard.admit(fits - 64, 64) is not None
    assert MemoryGuard(plan, limit_bytes=64 * GIB).max_context_tokens() == plan.context_length


def test_limit_settings():
    total = 32 * GIB
    assert resolve_limit(12, total) == 12 * GIB
    assert resolve_limit(64, total) == total
    assert resolve_limit("max", total) == total - int(3.2 * GIB)
    assert 0 < resolve_limit("auto", total) < total


def test_pressure_levels_from_free_memory():
    from mtplxd.pressure import pressure_from_available

    total = 32 * GIB
    assert pressure_from_available(16 * GIB, total) == "normal"
    assert pressure_from_available(int(1.5 * GIB), total) == "warn"
    assert pressure_from_available(GIB // 2, total) == "critical"


def test_pressure_loop_sheds_the_bank():
    import trio

    from mtplxd.pressure import watch_pressure

    bank = {"bytes": 1000}
    levels = iter(["normal", "warn", "critical"])

    def release(needed: int) -> int:
        freed = min(needed, bank["bytes"])
        bank["bytes"] -= freed
        return freed

    async def main() -> None:
        with trio.move_on_after(1):
            await watch_pressure(lambda: bank["bytes"], release, lambda: next(levels, "normal"), 0.01)

    trio.run(main)
    assert bank["bytes"] == 0



def test_pressure_loop_survives_a_reading_the_os_refuses(caplog):
    """Out of descriptors, /proc/meminfo cannot be opened: that round is skipped (said once),
    the loop goes on, and sheds the bank once readings come back."""
    import errno

    import trio

    from mtplxd.pressure import watch_pressure

    bank = {"bytes": 1000}
    readings = iter([OSError(errno.EMFILE, "Too many open files")] * 3 + ["critical"])

    def read() -> str:
        reading = next(readings, "normal")
        if isinstance(reading, OSError):
            raise reading
        return reading

    def release(needed: int) -> int:
        bank["bytes"] -= needed
        return needed

    async def main() -> None:
        with trio.move_on_after(1):
            await watch_pressure(lambda: bank["bytes"], release, read, 0.01)

    trio.run(main)
    assert bank["bytes"] == 0
    assert [r.getMessage() for r in caplog.records].count(
        "memory pressure: cannot read it ([Errno 24] Too many open files); trying again every 0 s") == 1


def test_served_window_keeps_the_models_context_and_is_zero_not_unbounded_when_nothing_fits():
    plan = plan_for_config(QWEN3_4B, weights_bytes=8 * GIB)
    tight = context_window(plan.context_length, MemoryGuard(plan, limit_bytes=9 * GIB))
    assert tight.model == 40960 and 0 < tight.served < 40960 and tight.limited_by == "memory"
    roomy = context_window(plan.context_length, MemoryGuard(plan, limit_bytes=64 * GIB))
    assert (roomy.served, roomy.limited_by) == (40960, "model")
    starved = context_window(plan.context_length, MemoryGuard(plan, limit_bytes=8 * GIB))
    assert (starved.served, starved.limited_by) == (0, "memory")
    assert context_window(0, MemoryGuard(plan, limit_bytes=8 * GIB)).served == 0
    assert context_window(4096, None).to_dict() == {
        "context_length": 4096, "model_context_length": 4096, "context_limited_by": "model"}


def test_a_prompt_over_the_memory_window_is_refused_naming_memory_and_counted():
    plan = plan_for_config(QWEN3_4B, weights_bytes=8 * GIB)
    guard = MemoryGuard(plan, limit_bytes=9 * GIB)
    window = context_window(plan.context_length, guard)
    refusal = guard.refuse_prompt(window.served + 10, window)
    assert isinstance(refusal, InsufficientMemory) and guard.refused == 1
    assert refusal.needed_bytes > refusal.available_bytes
    assert str(refusal).startswith(f"the memory limit caps this server's context at {window.served} tokens "
                                   f"(the model's is 40960)")


def test_rows_side_by_side_wait_while_they_could_fit_later_and_are_refused_when_never():
    plan = plan_for_config(QWEN3_4B, weights_bytes=8 * GIB)
    guard = MemoryGuard(plan, limit_bytes=10 * GIB, serial=False)
    tokens = int(1.5 * GIB // (147_456 + 4_096))
    running = guard.try_admit(tokens - 512, 256)
    assert running is not None
    assert guard.try_admit(tokens - 512, 256) is None  # fits once `running` leaves: it waits
    assert guard.refused == 0
    guard.check(tokens - 512, 256)  # at arrival: could fit alone, so it may queue
    with pytest.raises(InsufficientMemory):
        guard.check(3 * tokens, 0)  # could never fit: refused before it queues
    with pytest.raises(InsufficientMemory):
        guard.try_admit(3 * tokens, 0)
    running.release()
    assert guard.try_admit(tokens - 512, 256) is not None


def test_admission_never_prefills_in_larger_chunks_than_asked():
    plan = plan_for_config(QWEN3_4B, weights_bytes=1 * GIB)
    guard = MemoryGuard(plan, limit_bytes=32 * GIB, serial=False)
    assert guard.admit(4096, 0, prefill_chunk=128).prefill_chunk == 128


def test_images_are_priced_on_top_of_their_tokens():
    plan = plan_for_config(QWEN3_4B, weights_bytes=1 * GIB)
    guard = MemoryGuard(plan, limit_bytes=2 * GIB)
    text = guard.admit(1000, 100)
    with_image = guard.admit(1000, 100, extra_bytes=64 * 1024 * 1024)
    assert with_image.bytes == text.bytes + 64 * 1024 * 1024
    with_image.release()
    text.release()
    with pytest.raises(InsufficientMemory):
        guard.check(1000, 100, extra_bytes=2 * GIB)  # the tokens fit, the image does not
    guard.check(1000, 100)


def test_a_cohorts_padding_is_held_beside_the_rows_and_a_join_that_does_not_fit_is_declined():
    """hold_cohort holds what a fused cohort's buffers reach beyond its rows' own KV prices;
    new admissions see it; growth past the limit is declined (unchanged) unless `must`."""
    plan = plan_for_config(QWEN3_4B, weights_bytes=8 * GIB)
    guard = MemoryGuard(plan, limit_bytes=10 * GIB, serial=False)
    per_slot = plan.kv_bytes_per_token + plan.mtp_kv_bytes_per_token
    rows = [guard.try_admit(200, 56), guard.try_admit(1000, 24)]  # ceilings 256 and 1024
    reserved = guard.held_bytes()
    # Two rows 3 wide at the long row's 1024 slots: 3072 slots against 256 + 1024 priced.
    assert guard.hold_cohort("c", 3 * 1024 * per_slot, [256, 1024])
    padding = (3 * 1024 - 256 - 1024) * per_slot
    assert guard.held_bytes() == reserved + padding
    assert guard.holders()["cohort_padding"] == padding
    assert guard.holders()["running_requests"] == reserved
    available = guard.available_bytes()
    too_wide = 3 * 1024 * per_slot + available + per_slot
    assert not guard.hold_cohort("c", too_wide, [256, 1024])
    assert guard.cohort_padding_bytes() == padding  # declined: unchanged
    assert guard.hold_cohort("c", too_wide, [256, 1024], must=True)
    assert guard.available_bytes() < 0
    assert guard.try_admit(200, 56) is None  # waits: the padding goes when the rows do
    guard.hold_cohort("c", 1024 * per_slot, [1024], must=True)  # the short row left: 1 wide
    assert guard.cohort_padding_bytes() == 0
    guard.free_cohort("c")
    for row in rows:
        row.release()
    assert guard.held_bytes() == 0 and guard.holders()["cohort_padding"] == 0


def test_the_every_row_gdn_verify_is_priced_as_depth_plus_one_states():
    """On CUDA a hybrid's verify keeps each row's recurrent state until the accept decides
    (gdn_kernel.verify_rows): depth 3 on the 27B holds 4 more sequences' recurrent state."""
    from mtplxd.guard import verify_state_bytes

    plan = plan_for_config(QWEN35_27B, weights_bytes=16 * GIB)
    per_sequence = 48 * (48 * 128 * 128 * 4 + 3 * (2 * 16 * 128 + 48 * 128) * 2)
    assert plan.recurrent_bytes_per_sequence == per_sequence == 153_944_064
    assert verify_state_bytes(plan, 3, "CUDA kernel") == 4 * per_sequence
    assert verify_state_bytes(plan, 0, "CUDA kernel") == 0  # AR: no verify
    assert verify_state_bytes(plan, 3, "chunked") == verify_state_bytes(plan, 3, "per-token") == 0
    dense = plan_for_config(QWEN3_4B, weights_bytes=8 * GIB)
    assert verify_state_bytes(dense, 3, None) == 0


def test_the_runtime_adds_it_to_what_a_hybrid_request_is_priced(tmp_path):
    """A real runtime serving a tiny hybrid; its GDN verify path set to the CUDA kernel's
    (what this CPU cannot run): a request's extra bytes are depth + 1 recurrent states."""
    import trio

    from mtplxd.engine import GenerationRequest, SamplingParams
    from mtplxd.engine.fixtures.tiny import write_tiny_checkpoint
    from mtplxd.runtime import Runtime

    checkpoint = write_tiny_checkpoint(tmp_path / "tiny-hybrid", "qwen3_5")
    seen = {}

    async def main() -> None:
        runtime = Runtime(tmp_path, 3)
        runtime.start()
        try:
            await runtime.load(str(checkpoint))
            model, plan = runtime.model, runtime.guard.plan
            request = GenerationRequest([1, 2, 3], SamplingParams(max_tokens=4))
            seen["cpu"] = runtime._extra_bytes(model, request)
            model.info.kernels["gdn_verify"] = "CUDA kernel"
            seen["cuda"] = runtime._extra_bytes(model, request)
            request.depth = 0
            seen["ar"] = runtime._extra_bytes(model, request)
            seen["per_sequence"], seen["depth"] = plan.recurrent_bytes_per_sequence, model.info.depth
        finally:
            runtime.stop()

    trio.run(main)
    assert seen["cpu"] == 0 and seen["ar"] == 0
    assert seen["cuda"] == (seen["depth"] + 1) * seen["per_sequence"] > 0
