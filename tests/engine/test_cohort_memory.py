"""Fused cohorts' padding under the memory guard (decoding/cohort_memory.py, guard.hold_cohort).

A fused cohort stores every row's KV buffers at its longest row's capacity and pads itself to
a cohort width. A real scheduler (turned by hand) with a real MemoryGuard (the daemon's
build_guard and cohort_memory wiring) runs rows of very different lengths: at every turn the
KV bytes the guard holds cover the cohort buffers' real size (measured on the arrays); a row
whose join does not fit runs in a cohort of its own, still exact; nothing stays held after.
"""

from __future__ import annotations

from mtplxd.engine import GenerationRequest, SamplingParams
from mtplxd.engine.scheduler import Row, Scheduler
from mtplxd.guard import DEFAULT_PREFILL_CHUNK, GIB, MemoryGuard
from mtplxd.runtime import build_guard, cohort_memory
from support.rows import PROMPTS, Collector, assert_each_row_equals

# Very different lengths: (prompt tokens, max_tokens) of a short row, a medium one and a long
# one (a 300-token prompt: its own ceiling is a 512-slot buffer, the others' 256).
LENGTHS = ((None, 8), (None, 40), (300, 40))


def guard_for(tiny_model_factory, model, limit_bytes: int = 4 * GIB) -> MemoryGuard:
    return build_guard(tiny_model_factory("qwen3"), model, limit_bytes)


def guarded_scheduler(guard: MemoryGuard, max_concurrent: int = 3) -> Scheduler:
    """The fused cohorts of the daemon, admitting through `guard` as Runtime._admit_row does."""

    def admit(request: GenerationRequest):
        chunk = request.prefill_chunk or DEFAULT_PREFILL_CHUNK
        reservation = guard.try_admit(len(request.prompt_ids), request.sampling.max_tokens, chunk)
        return None if reservation is None else reservation.release

    return Scheduler(max_concurrent=max_concurrent, admit=admit, cohort_mode="always",
                     numerics="throughput", cohort_cycle="fused",
                     cohort_memory=cohort_memory(lambda: guard))


def requests_for(model, lengths=LENGTHS) -> list[GenerationRequest]:
    """Greedy depth-3 rows; a prompt length of None: PROMPTS[i] as it is, else that many
    tokens of PROMPTS[i] repeated."""
    requests = []
    for i, (prompt_tokens, max_tokens) in enumerate(lengths):
        ids = model.tokenizer.encode(PROMPTS[i])
        if prompt_tokens is not None:
            ids = (ids * (prompt_tokens // len(ids) + 1))[:prompt_tokens]
        requests.append(GenerationRequest(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                          depth=3))
    return requests


def add_rows(scheduler: Scheduler, model, requests: list[GenerationRequest]
             ) -> tuple[list[Row], list[Collector]]:
    log: list = []
    sinks = [Collector(f"r{i}", log) for i in range(len(requests))]
    rows = [scheduler.submit(Row(r, lambda stop, cohort, r=r: model.generate_steps(r, stop, cohort=cohort),
                                 sink, cohort_capable=True))
            for r, sink in zip(requests, sinks)]
    return rows, sinks


def cohort_buffer_bytes(scheduler: Scheduler) -> int:
    """What the fused cohorts' KV buffers really take now (trunk and head, every row)."""
    return sum(array.nbytes for cohort in scheduler.fused.cohorts if cohort.state is not None
               for array in cohort.state.trunk_kv + cohort.state.head_kv)


def members_kv_price(scheduler: Scheduler, guard: MemoryGuard) -> int:
    """What the cohorts' rows' own reservations price for their KV (each its own ceiling)."""
    return sum(guard.plan.kv_bytes(row.ceiling) for cohort in scheduler.fused.cohorts
               for row in cohort.live_members())


def turn_checking_cover(scheduler: Scheduler, guard: MemoryGuard, on_turn=lambda turn: None
                        ) -> dict[str, int]:
    """Turn until idle; at every turn the KV the guard holds (the members' own prices plus
    the cohorts' padding) covers the cohort buffers. Returns the peak figures."""
    peak = {"buffers": 0, "rows_priced": 0, "held_kv": 0, "cohorts": 0, "slot_bytes": 0}
    turn = 0
    while scheduler.has_work():
        scheduler.turn()
        turn += 1
        on_turn(turn)
        buffers = cohort_buffer_bytes(scheduler)
        priced = members_kv_price(scheduler, guard)
        held_kv = priced + guard.cohort_padding_bytes()
        assert held_kv >= buffers, (turn, held_kv, buffers)
        live = [cohort for cohort in scheduler.fused.cohorts if cohort.rows]
        peak["cohorts"] = max(peak["cohorts"], len(live))
        if buffers > peak["buffers"]:
            peak.update(buffers=buffers, rows_priced=priced, held_kv=held_kv,
                        slot_bytes=live[0].slot_bytes)
        assert turn < 10_000
    return peak


def test_the_guard_holds_at_every_turn_what_a_padded_fused_cohort_of_uneven_rows_takes(
        tiny_qwen3, tiny_model_factory):
    model = tiny_qwen3
    guard = guard_for(tiny_model_factory, model)
    scheduler = guarded_scheduler(guard)
    requests = requests_for(model)
    references = [model.complete(GenerationRequest(list(r.prompt_ids), r.sampling, depth=0))
                  for r in requests]
    _, sinks = add_rows(scheduler, model, requests)
    peak = turn_checking_cover(scheduler, guard)
    assert_each_row_equals(sinks, references, [3, 3, 3])
    assert all(s.result.stats.cohort_widths.get("3") for s in sinks)  # they ran together
    # The rows' own prices alone would not have covered the padded buffers.
    assert peak["rows_priced"] < peak["buffers"] <= peak["held_kv"]
    # The guard's price of a KV slot is what a buffer slot really takes (float32 on the CPU).
    plan = guard.plan
    assert peak["slot_bytes"] == plan.kv_bytes_per_token + plan.mtp_kv_bytes_per_token
    print(f"peak: cohort buffers {peak['buffers']} B, the rows' own KV prices "
          f"{peak['rows_priced']} B, held with the padding {peak['held_kv']} B")
    assert guard.held_bytes() == 0 and guard.holders()["cohort_padding"] == 0


def test_nothing_stays_held_after_a_row_is_cancelled_out_of_its_cohort(tiny_qwen3, tiny_model_factory):
    model = tiny_qwen3
    guard = guard_for(tiny_model_factory, model)
    scheduler = guarded_scheduler(guard)
    rows, sinks = add_rows(scheduler, model, requests_for(model, ((None, 100), (300, 200), (None, 80))))
    seen = {}

    def cancel_the_long_row(turn: int) -> None:
        if turn == 8:
            rows[1].cancel()
        if turn == 9:  # it left: its slot's buffers stay, held as padding now
            seen["padding"] = guard.cohort_padding_bytes()

    turn_checking_cover(scheduler, guard, cancel_the_long_row)
    assert sinks[1].result.finish_reason == "cancelled"
    assert [s.result.finish_reason for s in (sinks[0], sinks[2])] == ["length", "length"]
    assert seen["padding"] > 0
    assert guard.held_bytes() == 0 and guard.holders()["cohort_padding"] == 0


def test_rows_that_fit_apart_but_not_padded_together_run_in_cohorts_of_their_own_exactly(
        tiny_qwen3, tiny_model_factory):
    model = tiny_qwen3
    requests = requests_for(model, ((None, 8), (300, 40)))
    probe = guard_for(tiny_model_factory, model)
    plan = probe.plan
    own = sum(plan.request_bytes(len(r.prompt_ids), r.sampling.max_tokens, DEFAULT_PREFILL_CHUNK)
              for r in requests)
    slot = plan.kv_bytes_per_token + plan.mtp_kv_bytes_per_token
    # Room for both rows and 100 more slots: 3 wide at 512 slots would need 768 more.
    limit = plan.weights_bytes + own + 100 * slot
    guard = guard_for(tiny_model_factory, model, limit)
    scheduler = guarded_scheduler(guard)
    references = [model.complete(GenerationRequest(list(r.prompt_ids), r.sampling, depth=0))
                  for r in requests]
    _, sinks = add_rows(scheduler, model, requests)
    under_limit = []

    def never_over_the_limit(turn: int) -> None:
        under_limit.append(guard.held_bytes() <= limit - plan.weights_bytes)

    peak = turn_checking_cover(scheduler, guard, never_over_the_limit)
    assert all(under_limit)
    assert peak["cohorts"] == 2  # side by side, each in its own
    assert_each_row_equals(sinks, references, [3, 3])
    assert [s.result.stats.cohort_widths.keys() for s in sinks] == [{"1"}, {"1"}]  # each alone
    assert guard.held_bytes() == 0 and guard.refused == 0
