"""Prometheus metrics of the server, in a registry of its own (so tests can build many apps).

Engine state (requests running/waiting, KV pages, KDA slots) is read from `engine.stats()` at
scrape time. Token counters, finish counters and the latency histograms are observed here, in the
server, from when each engine request's outputs arrive: TTFT from the HTTP request's arrival to
the first output token, inter-token latency (ITL) per token after the first (a delta that carries
k tokens counts k gaps of 1/k of its wait), end-to-end latency to the finishing output.
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

SUCCESS_REASONS = ("stop", "length")
REFUSED_REASONS = ("unauthorized", "too_large", "overloaded")
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """All metrics of one server. `registry` defaults to a fresh `CollectorRegistry`."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests_running = Gauge("mstar_requests_running", "Engine requests being generated.", registry=r)
        self.requests_waiting = Gauge("mstar_requests_waiting", "Engine requests queued for admission.", registry=r)
        self.kv_pages_used = Gauge("mstar_kv_pages_used", "MLA KV cache pages in use.", registry=r)
        self.kv_pages_total = Gauge("mstar_kv_pages_total", "MLA KV cache pages in all.", registry=r)
        self.kv_pages_usage = Gauge("mstar_kv_pages_usage_ratio", "Fraction of KV pages in use (0..1).", registry=r)
        self.kda_slots_used = Gauge("mstar_kda_slots_used", "KDA recurrent-state slots in use.", registry=r)
        self.kda_slots_total = Gauge("mstar_kda_slots_total", "KDA recurrent-state slots in all.", registry=r)
        self.kda_slots_usage = Gauge("mstar_kda_slots_usage_ratio", "Fraction of KDA slots in use (0..1).", registry=r)
        self.spec_verify_rows = Gauge("mstar_spec_verify_rows", "Speculative verify rows run (cumulative).",
                                      registry=r)
        self.spec_draft_tokens = Gauge("mstar_spec_draft_tokens", "Draft tokens proposed (cumulative).", registry=r)
        self.spec_accepted_tokens = Gauge("mstar_spec_accepted_tokens", "Draft tokens accepted (cumulative).",
                                          registry=r)
        self.spec_mean_accepted_length = Gauge(
            "mstar_spec_mean_accepted_length", "Tokens emitted per verify row: accepted drafts + 1.", registry=r)
        self.spec_position_acceptance = Gauge(
            "mstar_spec_position_acceptance_rate", "Fraction of verify rows that proposed draft `position` and "
            "had it accepted.", ["position"], registry=r)
        self.spec_drafted_by_position = Gauge(
            "mstar_spec_drafted_by_position", "Verify rows that proposed draft `position` (cumulative).",
            ["position"], registry=r)
        self.spec_accepted_by_position = Gauge(
            "mstar_spec_accepted_by_position", "Verify rows whose draft `position` was accepted (cumulative).",
            ["position"], registry=r)
        self.prompt_tokens = Counter("mstar_prompt_tokens", "Prompt tokens of started requests.", registry=r)
        self.generation_tokens = Counter("mstar_generation_tokens", "Tokens generated.", registry=r)
        self.request_success = Counter(
            "mstar_request_success", "Engine requests that finished, by finish reason.", ["finish_reason"], registry=r
        )
        self.request_failure = Counter(
            "mstar_request_failure",
            "Requests that failed: error/abort (engine), cancelled (client gone), invalid_request (400).",
            ["reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "mstar_time_to_first_token_seconds", "Request arrival to first token.", buckets=_TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "mstar_inter_token_latency_seconds", "Time between output tokens.", buckets=_ITL_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "mstar_e2e_request_latency_seconds", "Request arrival to its last token.", buckets=_E2E_BUCKETS, registry=r
        )
        self.request_refused = Counter(
            "mstar_request_refused",
            "HTTP requests refused before reaching the engine: unauthorized (401), too_large (413), "
            "overloaded (429).",
            ["reason"],
            registry=r,
        )
        self.in_flight = Gauge("mstar_requests_in_flight", "Engine requests admitted by the server and not "
                               "yet ended (bounded by scheduler.max_num_seqs + scheduler.max_waiting).", registry=r)
        # A missing label value would not show up until first used; make every known one visible.
        for reason in SUCCESS_REASONS:
            self.request_success.labels(reason)
        for reason in ("error", "abort", "cancelled", "invalid_request"):
            self.request_failure.labels(reason)
        for reason in REFUSED_REASONS:
            self.request_refused.labels(reason)

    def update_engine_stats(self, stats: EngineStats) -> None:
        self.requests_running.set(stats.running)
        self.requests_waiting.set(stats.waiting)
        self.kv_pages_used.set(stats.kv_pages_used)
        self.kv_pages_total.set(stats.kv_pages_total)
        self.kv_pages_usage.set(stats.kv_pages_used / stats.kv_pages_total if stats.kv_pages_total else 0.0)
        self.kda_slots_used.set(stats.kda_slots_used)
        self.kda_slots_total.set(stats.kda_slots_total)
        self.kda_slots_usage.set(stats.kda_slots_used / stats.kda_slots_total if stats.kda_slots_total else 0.0)
        if stats.spec_verify_rows:
            self.spec_verify_rows.set(stats.spec_verify_rows)
            self.spec_draft_tokens.set(stats.spec_draft_tokens)
            self.spec_accepted_tokens.set(stats.spec_accepted_tokens)
            self.spec_mean_accepted_length.set(stats.spec_mean_accepted_length)
            for i, (drafted, accepted) in enumerate(zip(stats.spec_drafted_by_position,
                                                        stats.spec_accepted_by_position, strict=True)):
                position = str(i + 1)
                self.spec_drafted_by_position.labels(position=position).set(drafted)
                self.spec_accepted_by_position.labels(position=position).set(accepted)
                if drafted:
                    self.spec_position_acceptance.labels(position=position).set(accepted / drafted)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def invalid_request(self) -> None:
        self.request_failure.labels("invalid_request").inc()

    def refused(self, reason: str) -> None:
        self.request_refused.labels(reason).inc()

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
            self._finish(output.finish_reason or "stop", now)

    def _finish(self, reason: str, now: float) -> None:
        if self.done:
            return
        self.done = True
        self._metrics.e2e.observe(now - self._arrival)
        if reason in SUCCESS_REASONS:
            self._metrics.request_success.labels(reason).inc()
        else:
            self._metrics.request_failure.labels(reason).inc()

    def discard(self) -> None:
        """The engine refused the request (a 400, counted once per HTTP request by the server)."""
        self.done = True

    def fail(self, reason: str) -> None:
        """The request ended without a finishing output (client gone, invalid, server error)."""
        if not self.done:
            self.done = True
            self._metrics.request_failure.labels(reason).inc()
