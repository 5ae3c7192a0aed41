"""``GET /metrics``: Prometheus text from a registry of the server's own (prometheus_client).

The load gauges and token counters are read at scrape time from the engine loop's
:class:`~minijax_serve.server.engine_loop.LoadSnapshot` (published by the loop's thread, so a
scrape never touches the engine); the latency histograms are observed on the loop's thread as
each request finishes. Sequences (a request's prompts x n) add up: once the engine is idle,
``minijax_requests_submitted_total`` is the sum of ``minijax_requests_total`` over its finish
reasons (``stop``, ``length``, ``abort``, and ``error`` for an engine fault or the watchdog).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from minijax_serve.server.deltas import LoadSnapshot

PREFIX = "minijax"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0,
                   60.0)


class _LoadCollector(Collector):
    def __init__(self, snapshot: Callable[[], LoadSnapshot]):
        self._snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        s = self._snapshot()
        for name, doc, value in (
                ("num_requests_running", "Requests holding a slot (decoding or mid-prefill).",
                 s.running),
                ("num_requests_waiting", "Requests waiting for admission.", s.waiting),
                ("kv_cache_usage", "Share of the KV pool held by requests (0 to 1).", s.kv_usage),
                ("cache_hit_rate", "Share of prompt tokens taken from the prefix cache.",
                 s.cache_hit_rate)):
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)
        yield CounterMetricFamily(f"{PREFIX}_prompt_tokens", "Prompt tokens of every request.",
                                  value=s.prompt_tokens)
        yield CounterMetricFamily(f"{PREFIX}_generation_tokens", "Output tokens generated.",
                                  value=s.generated_tokens)
        for name, doc, value in (  # speculative decoding (0 when the engine does not speculate)
                ("spec_proposed_tokens", "Draft tokens verified.", s.spec_proposed_tokens),
                ("spec_accepted_tokens", "Draft tokens accepted.", s.spec_accepted_tokens),
                ("spec_verifies", "Verifies: a request's drafts checked in one step (accepted "
                 "length = (accepted + verifies) / verifies).", s.spec_verified_seqs)):
            yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)


class ServerMetrics:
    """The server's Prometheus registry."""

    def __init__(self, snapshot: Callable[[], LoadSnapshot]):
        self.registry = CollectorRegistry()
        self.registry.register(_LoadCollector(snapshot))

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(f"{PREFIX}_{name}", doc, buckets=LATENCY_BUCKETS,
                             registry=self.registry)

        self.ttft = histogram("time_to_first_token_seconds", "Time to the first output token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between two output tokens.")
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the finish.")
        self.finished = Counter(f"{PREFIX}_requests", "Sequences finished, by finish reason.",
                                ["finish_reason"], registry=self.registry)
        self._submitted = Counter(f"{PREFIX}_requests_submitted",
                                  "Sequences (prompts x n) added to the engine.",
                                  registry=self.registry)

    def submitted(self, count: int) -> None:
        self._submitted.inc(count)

    def failed(self, count: int) -> None:
        self.finished.labels("error").inc(count)

    def observe(self, out: Any) -> None:
        """Record a finished request's latencies (called on the engine loop's thread)."""
        if not out.finished:
            return
        times = out.token_times
        if out.first_token_time is not None:
            self.ttft.observe(out.first_token_time - out.arrival_time)
        for a, b in zip(times, times[1:]):
            self.itl.observe(b - a)
        if out.finish_time is not None:
            self.e2e.observe(out.finish_time - out.arrival_time)
        self.finished.labels(out.finish_reason).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)
