"""Prometheus metrics (`GET /metrics`, text exposition format) through prometheus_client.

Counters and histograms are fed from each finished generation's engine stats; gauges
(active requests, model facts, memory) are read when scraped. Names follow Prometheus
conventions with an `mtplx_` prefix; speculative counters mirror vLLM's
`spec_decode_num_*_tokens_total`, split by draft position.
"""

from __future__ import annotations

from typing import Any, Callable

import psutil
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST, disable_created_metrics

CONTENT_TYPE = CONTENT_TYPE_LATEST
# `*_created` timestamp series double the output and no dashboard here uses them.
disable_created_metrics()

QUEUE_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64)
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
RATE_BUCKETS = (1, 2, 5, 10, 20, 30, 40, 60, 80, 100, 150, 200, 400, 1000)


class Metrics:
    """One registry per app (tests run several apps in one process)."""

    def __init__(self, runtime: Any, recorder: Any = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("mtplx_requests", "HTTP API requests answered",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("mtplx_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("mtplx_generation_tokens", "Tokens generated", registry=r)
        self.cached_tokens = Counter("mtplx_cached_prompt_tokens", "Prompt tokens served from cache",
                                     registry=r)
        self.finished = Counter("mtplx_generations", "Generations finished, by finish reason",
                                ["finish_reason"], registry=r)
        self.ttft = Histogram("mtplx_time_to_first_token_seconds", "Time to first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.decode_rate = Histogram("mtplx_decode_tokens_per_second", "Decode rate per request",
                                     buckets=RATE_BUCKETS, registry=r)
        self.prefill_rate = Histogram("mtplx_prefill_tokens_per_second", "Prefill rate per request",
                                      buckets=(100, 250, 500, 1000, 2000, 4000, 8000, 16000),
                                      registry=r)
        self.drafted = Counter("mtplx_spec_decode_draft_tokens", "MTP draft tokens proposed",
                               ["position"], registry=r)
        self.accepted = Counter("mtplx_spec_decode_accepted_tokens", "MTP draft tokens accepted",
                                ["position"], registry=r)
        self.cycles = Counter("mtplx_spec_decode_cycles", "Speculative verify cycles", registry=r)
        self.committed = Counter("mtplx_spec_decode_committed_tokens",
                                 "Tokens committed by speculative verify cycles", registry=r)
        self.repetition_stops = Counter("mtplx_repetition_stops",
                                        "Generations ended by the runaway-loop guard", registry=r)
        self.repetition_trimmed = Counter("mtplx_repetition_trimmed_tokens",
                                          "Repeated tokens the loop guard kept from clients", registry=r)
        self.retrieval_requests = Counter("mtplx_retrieval_requests", "Embedding and rerank requests served",
                                          ["kind"], registry=r)
        self.retrieval_inputs = Counter("mtplx_retrieval_inputs",
                                        "Texts embedded and documents reranked", ["kind"], registry=r)
        self.retrieval_tokens = Counter("mtplx_retrieval_tokens", "Tokens read by retrieval models",
                                        ["kind"], registry=r)
        self.queue_wait = Histogram("mtplx_queue_wait_seconds",
                                    "Time from arrival to admission into a scheduler row",
                                    buckets=QUEUE_WAIT_BUCKETS, registry=r)
        # The cohort-width histogram: a row's decode cycles, by the width of the cohort whose
        # batched verify it ran in (rows outside cohorts add nothing).
        self.cohort_cycles = Counter("mtplx_cohort_row_cycles",
                                     "Decode cycles rows ran in an MTP cohort, by cohort width",
                                     ["width"], registry=r)
        self.mean_accept = Gauge("mtplx_spec_decode_mean_acceptance_length",
                                 "Tokens committed per verify cycle since start", registry=r)
        self.mean_accept.set_function(self._mean_acceptance)
        active = Gauge("mtplx_active_requests", "Generations in flight", registry=r)
        active.set_function(lambda: runtime.active_requests)
        running = Gauge("mtplx_scheduler_running_rows", "Generations decoding (scheduler rows)",
                        registry=r)
        running.set_function(lambda: runtime.scheduler_status()["running"])
        queued = Gauge("mtplx_scheduler_queued_requests", "Generations waiting for a row",
                       registry=r)
        queued.set_function(lambda: runtime.scheduler_status()["queued"])
        paused = Gauge("mtplx_scheduler_paused_rows",
                       "Rows paused because their reader has not taken their output", registry=r)
        paused.set_function(lambda: runtime.scheduler_status().get("paused", 0))
        moved = Gauge("mtplx_scheduler_rows_moved_into_cohorts",
                      "Rows that started decoding alone and moved into cohorts since start", registry=r)
        moved.set_function(lambda: runtime.scheduler_status().get("moved_into_cohorts", 0))
        loaded = Gauge("mtplx_model_loaded", "1 while a model is loaded", registry=r)
        loaded.set_function(lambda: 1 if runtime.state == "loaded" else 0)
        depth = Gauge("mtplx_model_depth", "Default MTP depth of the loaded model (0 = AR)", registry=r)
        depth.set_function(_from_info(runtime, "depth"))
        weights = Gauge("mtplx_model_weights_bytes", "Bytes of the loaded model's weights", registry=r)
        weights.set_function(_from_info(runtime, "weights_bytes"))
        rss = Gauge("mtplx_process_resident_memory_bytes", "Resident memory of the daemon", registry=r)
        rss.set_function(lambda: psutil.Process().memory_info().rss)
        available = Gauge("mtplx_system_available_memory_bytes", "Memory available on the machine",
                          registry=r)
        available.set_function(lambda: psutil.virtual_memory().available)
        if recorder is not None:  # the flight recorder: records on disk, and lost ones
            for name, what in (("written", "Flight records written"),
                               ("dropped", "Flight records lost (queue full or disk failing)")):
                gauge = Gauge(f"mtplx_flight_records_{name}", what, registry=r)
                gauge.set_function(lambda name=name: getattr(recorder, name))

    def _mean_acceptance(self) -> float:
        cycles = self.cycles._value.get()
        return self.committed._value.get() / cycles if cycles else 0.0

    def observe_request(self, endpoint: str, status: int) -> None:
        """Count one answered request."""
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def observe_generation(self, stats: Any) -> None:
        """Fold one finished generation's engine stats in."""
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generation_tokens.inc(stats.completion_tokens)
        self.cached_tokens.inc(stats.cached_tokens)
        self.finished.labels(finish_reason=stats.finish_reason).inc()
        self.queue_wait.observe(stats.queue_wait_seconds)
        if stats.repetition_stop:
            self.repetition_stops.inc()
            self.repetition_trimmed.inc(stats.repetition_trimmed_tokens)
        if stats.completion_tokens:
            self.ttft.observe(stats.ttft_seconds)
        if stats.decode_tokens_per_second > 0:
            self.decode_rate.observe(stats.decode_tokens_per_second)
        if stats.prefill_tokens_per_second > 0:
            self.prefill_rate.observe(stats.prefill_tokens_per_second)
        for i, (drafted, accepted) in enumerate(zip(stats.drafted_by_depth, stats.accepted_by_depth)):
            self.drafted.labels(position=str(i + 1)).inc(drafted)
            self.accepted.labels(position=str(i + 1)).inc(accepted)
        for width, cycles in getattr(stats, "cohort_widths", {}).items():
            self.cohort_cycles.labels(width=width).inc(cycles)
        if stats.depth > 0 and stats.cycles:
            self.cycles.inc(stats.cycles)
            self.committed.inc(stats.mean_accepted_length * stats.cycles)

    def observe_retrieval(self, kind: str, inputs: int, tokens: int) -> None:
        """Count one embeddings or rerank request (`kind`), its inputs and tokens."""
        self.retrieval_requests.labels(kind=kind).inc()
        self.retrieval_inputs.labels(kind=kind).inc(inputs)
        self.retrieval_tokens.labels(kind=kind).inc(tokens)

    def observe_unfinished(self, why: str) -> None:
        """A generation that ended without a result: `cancelled` (client left) or `error`."""
        self.finished.labels(finish_reason=why).inc()

    def render(self) -> bytes:
        """The exposition text."""
        return generate_latest(self.registry)


def _from_info(runtime: Any, key: str) -> Callable[[], float]:
    def read() -> float:
        info = runtime.info()
        return float(info.get(key) or 0) if info else 0.0

    return read
