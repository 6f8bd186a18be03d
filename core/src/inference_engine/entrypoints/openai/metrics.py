"""Prometheus metrics for ``GET /metrics``.

Latency histograms and token counters are kept by the server as outputs
stream; engine gauges (queue lengths, KV usage, prefix-cache hit rate) are
read from the engine at scrape time. Each app has its own registry, so
several servers can live in one process (tests).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = ["RequestTimer", "ServerMetrics", "VLLM_NAMED"]

PREFIX = "inference_engine:"
VLLM_PREFIX = "vllm:"
# Our metrics that vLLM has under the same name after its prefix (``--vllm-metric-names``
# repeats these); prefix_cache_hit_rate and num_samples_held have no vLLM twin.
VLLM_NAMED = frozenset({
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
    "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens",
    "generation_tokens", "request_success", "time_to_first_token_seconds",
    "inter_token_latency_seconds", "e2e_request_latency_seconds",
    "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
    "spec_decode_num_accepted_tokens_per_pos"})

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class _EngineCollector:
    """Turns the engine's last stats snapshot into gauges at scrape time."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.snapshot: dict[str, float] = {}

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot
        labels = ["model_name"]
        for key, name, doc in (
            ("num_running", "num_requests_running", "Requests scheduled on the engine."),
            ("num_waiting", "num_requests_waiting", "Requests queued, not yet scheduled."),
            ("kv_cache_usage", "kv_cache_usage_perc", "Share of KV blocks in use (0-1)."),
            ("prefix_cache_hit_rate", "prefix_cache_hit_rate",
             "Prompt tokens served from the prefix cache / prompt tokens looked up."),
            ("num_held_samples", "num_samples_held",
             "Samples of n > 1 requests held back until their group's running ones finish."),
        ):
            gauge = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            gauge.add_metric([self.model_name], float(s.get(key, 0.0)))
            yield gauge
        for key, name, doc in (
            ("prefix_cache_queried_tokens", "prefix_cache_queries",
             "Prompt tokens looked up in the prefix cache."),
            ("prefix_cache_hit_tokens", "prefix_cache_hits",
             "Prompt tokens found in the prefix cache."),
            ("num_preemptions", "num_preemptions", "Sequences preempted for lack of KV blocks."),
        ):
            counter = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            counter.add_metric([self.model_name], float(s.get(key, 0.0)))
            yield counter
        load = s.get("expert_load")
        if load:  # tensor/expert parallel MoE models: per-expert routed assignments
            counter = CounterMetricFamily(
                PREFIX + "moe_expert_load", "(token, slot) assignments routed to each expert "
                "of each MoE layer.", labels=[*labels, "layer", "expert"])
            for layer, counts in sorted(load.items()):
                for expert, count in enumerate(counts):
                    counter.add_metric([self.model_name, str(layer), str(expert)], float(count))
            yield counter


class _SpecDecodeCollector:
    """Speculative decoding counters (vLLM's names), present when the engine speculates."""

    def __init__(self, engine: _EngineCollector) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        s = self.engine.snapshot
        if "spec_decode_num_drafts" not in s:
            return
        labels = ["model_name"]
        model = self.engine.model_name
        for key, doc in (
            ("spec_decode_num_drafts", "Request-steps that verified drafts."),
            ("spec_decode_num_draft_tokens", "Draft tokens verified."),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted."),
        ):
            counter = CounterMetricFamily(PREFIX + key, doc, labels=labels)
            counter.add_metric([model], float(s[key]))
            yield counter
        per_pos = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Request-steps whose draft at this position was accepted.",
            labels=[*labels, "position"])
        for position, count in enumerate(s["spec_decode_num_accepted_tokens_per_pos"]):
            per_pos.add_metric([model, str(position)], float(count))
        yield per_pos
        gauge = GaugeMetricFamily(PREFIX + "spec_decode_mean_acceptance_length",
                                  "Tokens emitted per verifying request-step (1 + accepted).",
                                  labels=labels)
        gauge.add_metric([model], float(s["spec_decode_mean_acceptance_length"]))
        yield gauge


class _VLLMNamedCollector:
    """Our families that vLLM also has, again under ``vllm:`` (dashboards built for vLLM)."""

    def __init__(self, source: CollectorRegistry) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            short = family.name.removeprefix(PREFIX)
            if short not in VLLM_NAMED:
                continue
            twin = Metric(VLLM_PREFIX + short, family.documentation, family.type)
            twin.samples = [s._replace(name=VLLM_PREFIX + s.name.removeprefix(PREFIX))
                            for s in family.samples]
            yield twin


class ServerMetrics:
    """The server's metric objects and the registry they live in."""

    def __init__(self, model_name: str, vllm_names: bool = False) -> None:
        self.registry = CollectorRegistry()
        # vLLM's names, rendered after ours from the same values (None: off).
        self.vllm_registry: CollectorRegistry | None = None
        if vllm_names:
            self.vllm_registry = CollectorRegistry(auto_describe=False)
            self.vllm_registry.register(_VLLMNamedCollector(self.registry))
        self.model_name = model_name
        self._engine = _EngineCollector(model_name)
        self.registry.register(self._engine)
        self.registry.register(_SpecDecodeCollector(self._engine))
        labels = ["model_name"]
        kw: dict[str, Any] = {"registry": self.registry}
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished "
                                     "requests.", labels, **kw).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.",
                                         labels, **kw).labels(model_name)
        self._success = Counter(PREFIX + "request_success", "Finished requests by finish "
                                "reason.", labels + ["finished_reason"], **kw)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Arrival to first "
                              "generated token.", labels, buckets=_LATENCY_BUCKETS,
                              **kw).labels(model_name)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between a "
                             "request's consecutive output updates, per token.", labels,
                             buckets=_LATENCY_BUCKETS, **kw).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to finish.",
                             labels, buckets=_LATENCY_BUCKETS + (160.0, 320.0),
                             **kw).labels(model_name)

    def request_finished(self, reason: str | None) -> None:
        self._success.labels(self.model_name, reason or "unknown").inc()

    def render(self, engine_stats: dict[str, float]) -> bytes:
        """The Prometheus text exposition, with engine gauges from ``engine_stats``."""
        self._engine.snapshot = engine_stats
        text = generate_latest(self.registry)
        if self.vllm_registry is not None:
            text += generate_latest(self.vllm_registry)
        return text


class RequestTimer:
    """Per-request latency bookkeeping fed with each streamed output."""

    def __init__(self, metrics: ServerMetrics, arrival: float | None = None) -> None:
        self.metrics = metrics
        self.arrival = arrival if arrival is not None else time.perf_counter()
        self._last: float | None = None
        self._tokens = 0

    def observe(self, num_tokens: int) -> None:
        """The request's outputs now hold ``num_tokens`` tokens in all (all choices)."""
        new = num_tokens - self._tokens
        if new <= 0:
            return
        now = time.perf_counter()
        if self._last is None:
            self.metrics.ttft.observe(now - self.arrival)
        else:
            per_token = (now - self._last) / new
            for _ in range(new):
                self.metrics.itl.observe(per_token)
        self._last = now
        self._tokens = num_tokens

    def finish(self, num_prompt_tokens: int, reasons: list[str | None]) -> None:
        self.metrics.prompt_tokens.inc(num_prompt_tokens)
        self.metrics.generation_tokens.inc(self._tokens)
        self.metrics.e2e.observe(time.perf_counter() - self.arrival)
        for reason in reasons:
            self.metrics.request_finished(reason)
