"""Prometheus metrics of the server, in a registry of its own (so tests can build many apps).

vLLM's metric set under mstar_ names (`vllm:x` is `mstar_x`, where a vLLM metric exists), every one
labelled with `model_name` as vLLM's are. Kinds follow what is measured: a cumulative count is a
counter (graph its rate), a level a gauge, a per-request distribution a histogram.

Engine state (requests running/waiting, KV pages, KDA slots) is read from `engine.stats()` at
scrape time, and so are the engine's cumulative counts (preemptions, prefix-cache queries and hits
in tokens, speculative decoding, model steps by shape and by graph or eager): each
scrape adds what they grew by since the last. Token counters, finish counters and the latency
histograms are observed here, in the server, from when each engine request's outputs arrive: TTFT
from the HTTP request's arrival to the first output token, inter-token latency (ITL) per token
after the first (a delta that carries k tokens counts k gaps of 1/k of its wait), end-to-end
latency to the finishing output. Queue, prefill, decode and inference times are the engine's own
(`RequestOutput.times` on the finishing output): queued -> first scheduled -> first token -> end.
All counts are per engine request: a request with n choices is n engine requests.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from mstar.engine.client import EngineStats
from mstar.engine.outputs import RequestOutput

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)
_PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 480.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000)

SUCCESS_REASONS = ("stop", "length")
REFUSED_REASONS = ("unauthorized", "too_large", "overloaded")
CONTENT_TYPE = CONTENT_TYPE_LATEST
MODEL = ["model_name"]


class ServerMetrics:
    """All metrics of one server serving `model_name`. `registry` defaults to a fresh `CollectorRegistry`."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, MODEL, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, MODEL, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(name, doc, MODEL, buckets=buckets, registry=r).labels(model_name)

        self.requests_running = gauge("mstar_requests_running", "Engine requests being generated.")
        self.requests_waiting = gauge("mstar_requests_waiting", "Engine requests queued for admission.")
        self.kv_pages_used = gauge("mstar_kv_pages_used", "MLA KV cache pages in use.")
        self.kv_pages_total = gauge("mstar_kv_pages_total", "MLA KV cache pages in all.")
        self.kv_pages_usage = gauge("mstar_kv_pages_usage_ratio", "Fraction of KV pages in use (0..1).")
        self.kda_slots_used = gauge("mstar_kda_slots_used", "KDA recurrent-state slots in use.")
        self.kda_slots_total = gauge("mstar_kda_slots_total", "KDA recurrent-state slots in all.")
        self.kda_slots_usage = gauge("mstar_kda_slots_usage_ratio", "Fraction of KDA slots in use (0..1).")
        self.num_preemptions = counter("mstar_num_preemptions", "Requests preempted (caches freed, recomputed).")
        self.prefix_cache_queries = counter("mstar_prefix_cache_queries", "Tokens of the requests admitted, looked "
                                            "up in the prefix cache.")
        self.prefix_cache_hits = counter("mstar_prefix_cache_hits", "Tokens of the requests admitted that the "
                                         "prefix cache served.")
        self.spec_num_drafts = counter("mstar_spec_decode_num_drafts", "Speculative verify rows run.")
        self.spec_draft_tokens = counter("mstar_spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.spec_accepted_tokens = counter("mstar_spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_drafted_per_pos = Counter(
            "mstar_spec_decode_num_drafts_per_pos", "Verify rows that proposed draft `position`.",
            [*MODEL, "position"], registry=r)
        self.spec_accepted_per_pos = Counter(
            "mstar_spec_decode_num_accepted_tokens_per_pos", "Verify rows whose draft `position` was accepted.",
            [*MODEL, "position"], registry=r)
        self.model_steps = Counter(
            "mstar_model_steps", "Model steps run, by what they held (`shape`: decode, verify, prefill, "
            "prefill+verify) and how (`mode`: graph, a captured CUDA graph replayed, or eager).",
            [*MODEL, "shape", "mode"], registry=r)
        self.prompt_tokens = counter("mstar_prompt_tokens", "Prompt tokens of started requests.")
        self.generation_tokens = counter("mstar_generation_tokens", "Tokens generated.")
        self.request_success = Counter(
            "mstar_request_success", "Engine requests that finished, by finish reason.", [*MODEL, "finish_reason"],
            registry=r)
        self.request_failure = Counter(
            "mstar_request_failure",
            "Requests that failed: error/abort (engine), cancelled (client gone), invalid_request (400).",
            [*MODEL, "reason"], registry=r)
        self.ttft = histogram("mstar_time_to_first_token_seconds", "Request arrival to first token.", _TTFT_BUCKETS)
        self.itl = histogram("mstar_inter_token_latency_seconds", "Time between output tokens.", _ITL_BUCKETS)
        self.e2e = histogram("mstar_e2e_request_latency_seconds", "Request arrival to its last token.", _E2E_BUCKETS)
        self.queue_time = histogram("mstar_request_queue_time_seconds", "In the engine's queue before it was "
                                    "first scheduled.", _PHASE_BUCKETS)
        self.prefill_time = histogram("mstar_request_prefill_time_seconds", "First scheduled to first token.",
                                      _PHASE_BUCKETS)
        self.decode_time = histogram("mstar_request_decode_time_seconds", "First token to the last.", _E2E_BUCKETS)
        self.inference_time = histogram("mstar_request_inference_time_seconds", "First scheduled to the last "
                                        "token.", _E2E_BUCKETS)
        self.request_prompt_tokens = histogram("mstar_request_prompt_tokens", "Prompt tokens per request.",
                                               _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("mstar_request_generation_tokens", "Tokens generated per "
                                                   "finished request.", _TOKEN_BUCKETS)
        self.request_refused = Counter(
            "mstar_request_refused",
            "HTTP requests refused before reaching the engine: unauthorized (401), too_large (413), "
            "overloaded (429).",
            [*MODEL, "reason"], registry=r)
        self.in_flight = gauge("mstar_requests_in_flight", "Engine requests admitted by the server and not "
                               "yet ended (bounded by scheduler.max_num_seqs + scheduler.max_waiting).")
        # A missing label value would not show up until first used; make every known one visible.
        for reason in SUCCESS_REASONS:
            self.request_success.labels(model_name, reason)
        for reason in ("error", "abort", "cancelled", "invalid_request"):
            self.request_failure.labels(model_name, reason)
        for reason in REFUSED_REASONS:
            self.request_refused.labels(model_name, reason)
        self._engine_counts: dict[object, float] = {}  # the engine's cumulative counts at the last scrape

    def _count_up(self, child, total: float) -> None:
        """Add to `child` what the engine's cumulative `total` grew by since the last scrape."""
        grown = total - self._engine_counts.get(child, 0.0)
        if grown > 0:
            child.inc(grown)
            self._engine_counts[child] = total

    def update_engine_stats(self, stats: EngineStats) -> None:
        self.requests_running.set(stats.running)
        self.requests_waiting.set(stats.waiting)
        self.kv_pages_used.set(stats.kv_pages_used)
        self.kv_pages_total.set(stats.kv_pages_total)
        self.kv_pages_usage.set(stats.kv_pages_used / stats.kv_pages_total if stats.kv_pages_total else 0.0)
        self.kda_slots_used.set(stats.kda_slots_used)
        self.kda_slots_total.set(stats.kda_slots_total)
        self.kda_slots_usage.set(stats.kda_slots_used / stats.kda_slots_total if stats.kda_slots_total else 0.0)
        self._count_up(self.num_preemptions, stats.num_preemptions)
        self._count_up(self.prefix_cache_queries, stats.prefix_cache_queries)
        self._count_up(self.prefix_cache_hits, stats.prefix_cache_hits)
        self._count_up(self.spec_num_drafts, stats.spec_verify_rows)
        self._count_up(self.spec_draft_tokens, stats.spec_draft_tokens)
        self._count_up(self.spec_accepted_tokens, stats.spec_accepted_tokens)
        for i, (drafted, accepted) in enumerate(zip(stats.spec_drafted_by_position, stats.spec_accepted_by_position,
                                                    strict=True)):
            position = str(i + 1)
            self._count_up(self.spec_drafted_per_pos.labels(self.model_name, position), drafted)
            self._count_up(self.spec_accepted_per_pos.labels(self.model_name, position), accepted)
        for shape, mode, steps in stats.model_steps:
            self._count_up(self.model_steps.labels(self.model_name, shape, mode), steps)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def invalid_request(self) -> None:
        self.request_failure.labels(self.model_name, "invalid_request").inc()

    def refused(self, reason: str) -> None:
        self.request_refused.labels(self.model_name, reason).inc()

    def track(self, arrival: float, prompt_tokens: int) -> RequestTracker:
        return RequestTracker(self, arrival, prompt_tokens)


class RequestTracker:
    """Timing and counts of one engine request, fed with its outputs as they arrive."""

    def __init__(self, metrics: ServerMetrics, arrival: float, prompt_tokens: int):
        self._metrics = metrics
        self._arrival = arrival
        self._prompt_tokens = prompt_tokens
        self._last_token_at: float | None = None
        self.done = False

    def on_output(self, output: RequestOutput, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        m = self._metrics
        count = len(output.new_token_ids)
        if count:
            if self._last_token_at is None:
                m.prompt_tokens.inc(self._prompt_tokens)
                m.ttft.observe(now - self._arrival)
            else:
                gap = (now - self._last_token_at) / count
                for _ in range(count):
                    m.itl.observe(gap)
            self._last_token_at = now
            m.generation_tokens.inc(count)
        if output.finished:
            self._finish(output, now)

    def _finish(self, output: RequestOutput, now: float) -> None:
        if self.done:
            return
        self.done = True
        m = self._metrics
        m.e2e.observe(now - self._arrival)
        reason = output.finish_reason or "stop"
        if reason in SUCCESS_REASONS:
            m.request_success.labels(m.model_name, reason).inc()
            m.request_prompt_tokens.observe(self._prompt_tokens)
            m.request_generation_tokens.observe(output.num_output_tokens)
        else:
            m.request_failure.labels(m.model_name, reason).inc()
        times = output.times
        if times is not None:
            m.queue_time.observe(times.queue_s)
            for histogram, value in ((m.prefill_time, times.prefill_s), (m.decode_time, times.decode_s),
                                     (m.inference_time, times.inference_s)):
                if value is not None:
                    histogram.observe(value)

    def discard(self) -> None:
        """The engine refused the request (a 400, counted once per HTTP request by the server)."""
        self.done = True

    def fail(self, reason: str) -> None:
        """The request ended without a finishing output (client gone, invalid, server error)."""
        if not self.done:
            self.done = True
            self._metrics.request_failure.labels(self._metrics.model_name, reason).inc()
