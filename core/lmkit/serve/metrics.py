"""Prometheus metrics of the server (``GET /metrics``).

Request-level series are measured in the API process as outputs arrive (time to first
token, inter-token latency, end-to-end latency, requests by outcome, prompt and
generated tokens); so are whether the engine is up and how often it was restarted.
Engine-level series (running and waiting requests, KV-cache usage, prefix-cache hit
rate, preemptions, KV offload) come from ``EngineCore.stats()``, which the engine process
sends over the channel periodically (none while the engine is dead); every numeric
stat is also exported as ``lmkit_engine_stat{stat="..."}``. Every engine-level series
has an ``engine`` label (``"0"`` .. ``"N-1"`` with ``--dp N``; ``"0"`` alone otherwise),
and ``lmkit_router_requests_total{engine}`` counts the requests the router sent to each.
Each server has its own registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                    1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)

# (metric, help, stat keys to try in order) for the engine's gauges and counters
_ENGINE_GAUGES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("lmkit_num_requests_running", "Requests running in the engine.",
     ("num_running_reqs", "num_running", "num_running_requests")),
    ("lmkit_num_requests_waiting", "Requests waiting in the engine's queue.",
     ("num_waiting_reqs", "num_waiting", "num_waiting_requests")),
    ("lmkit_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0-1).",
     ("kv_cache_usage", "kv_usage", "kv_cache_usage_ratio")),
    ("lmkit_offload_used_bytes", "Bytes held by the KV offload tier.", ("offload_used_bytes",)),
    ("lmkit_offload_capacity_bytes", "Capacity of the KV offload tier in bytes.",
     ("offload_capacity_bytes",)),
    ("lmkit_spec_decode_acceptance_rate", "Accepted / verified draft tokens since start.",
     ("spec_acceptance_rate",)),
    ("lmkit_spec_decode_mean_accepted_length", "Tokens emitted per draft verification "
     "(1 + accepted drafts), mean since start.", ("spec_mean_accepted_length",)),
    ("lmkit_spec_decode_adaptive_drafting", "1 while adaptive speculation drafts, 0 while "
     "it holds drafting off (speculative.adaptive).", ("spec_adaptive_drafting",)),
)
_ENGINE_COUNTERS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("lmkit_num_preemptions", "Requests preempted (KV blocks ran out) since start.",
     ("num_preemptions", "preemptions")),
    ("lmkit_num_pooling_requests", "Pooling requests (embeddings, scores, classes) accepted "
     "since start.", ("num_pooling_requests",)),
    ("lmkit_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
     ("prefix_cache_queries",)),
    ("lmkit_prefix_cache_hits", "Prompt tokens found in the prefix cache.",
     ("prefix_cache_hits",)),
    ("lmkit_offload_stored_blocks", "KV blocks evicted from the device and sent to the "
     "offload tier.", ("offload_stored_blocks",)),
    ("lmkit_offload_hit_tokens", "Prompt tokens found in the offload tier at admission.",
     ("offload_hit_tokens",)),
    ("lmkit_offload_loaded_blocks", "KV blocks loaded back from the offload tier.",
     ("offload_loaded_blocks",)),
    ("lmkit_offload_bytes_stored", "Bytes copied to the offload tier.", ("offload_bytes_stored",)),
    ("lmkit_offload_bytes_loaded", "Bytes copied back from the offload tier.",
     ("offload_bytes_loaded",)),
    ("lmkit_offload_evictions", "KV blocks the offload tier dropped to make room.",
     ("offload_evictions",)),
    ("lmkit_offload_failed_loads", "Offload loads that failed (recomputed instead).",
     ("offload_failed_loads",)),
    ("lmkit_offload_failed_stores", "Offload stores that failed.", ("offload_failed_stores",)),
    ("lmkit_spec_decode_num_draft_tokens", "Draft tokens verified (speculative decoding).",
     ("spec_num_draft_tokens",)),
    ("lmkit_spec_decode_num_accepted_tokens", "Draft tokens accepted.",
     ("spec_num_accepted_tokens",)),
    ("lmkit_spec_decode_num_drafts", "Verifications: (request, step) pairs with drafts.",
     ("spec_num_verifications",)),
    ("lmkit_spec_decode_adaptive_probes", "Probes adaptive speculation finished (drafts "
     "timed against plain decoding).", ("spec_adaptive_probes",)),
)
_SPEC_POSITION_PREFIX = "spec_acceptance_rate_pos_"


def _first(stats: dict[str, float], keys: tuple[str, ...]) -> float | None:
    for k in keys:
        if k in stats:
            return float(stats[k])
    return None


class EngineStatsCollector:
    """Turns each engine's latest ``EngineCore.stats()`` into Prometheus families (one
    series per engine, labelled ``engine``) on each scrape, with the router's count of
    requests sent to each engine."""

    def __init__(self, get_stats: Callable[[], list[dict[str, float]]],
                 get_routed: Callable[[], list[int]] = list) -> None:
        self.get_stats = get_stats
        self.get_routed = get_routed

    def collect(self) -> Iterator[Any]:
        per_engine = [(str(i), stats or {}) for i, stats in enumerate(self.get_stats() or [])]
        families: dict[str, Any] = {}

        def family(kind: type, name: str, doc: str, *labels: str) -> Any:
            if name not in families:
                families[name] = kind(name, doc, labels=["engine", *labels])
            return families[name]

        for engine, stats in per_engine:
            for name, doc, keys in _ENGINE_GAUGES:
                value = _first(stats, keys)
                if value is not None:
                    family(GaugeMetricFamily, name, doc).add_metric([engine], value)
            for name, doc, keys in _ENGINE_COUNTERS:
                value = _first(stats, keys)
                if value is not None:
                    family(CounterMetricFamily, name, doc).add_metric([engine], value)
            hits = _first(stats, ("prefix_cache_hits",))
            queries = _first(stats, ("prefix_cache_queries",))
            rate = _first(stats, ("prefix_cache_hit_rate",))
            if rate is None and hits is not None and queries:
                rate = hits / queries
            if rate is not None:
                family(GaugeMetricFamily, "lmkit_prefix_cache_hit_rate", "Prefix-cache hits / "
                       "queries (tokens) since start.").add_metric([engine], rate)
            for key in sorted(k for k in stats if k.startswith(_SPEC_POSITION_PREFIX)):
                family(GaugeMetricFamily, "lmkit_spec_decode_acceptance_rate_per_position",
                       "Of the verifications with a draft at this position, the fraction "
                       "that accepted it.", "position").add_metric(
                    [engine, key[len(_SPEC_POSITION_PREFIX):]], float(stats[key]))
        yield from families.values()
        every = GaugeMetricFamily("lmkit_engine_stat", "Every numeric EngineCore.stats() value.",
                                  labels=["engine", "stat"])
        for engine, stats in per_engine:
            for key in sorted(stats):
                every.add_metric([engine, key], float(stats[key]))
        yield every
        routed = CounterMetricFamily("lmkit_router_requests", "Requests the router sent to "
                                     "each engine (data parallel) since start.",
                                     labels=["engine"])
        for i, count in enumerate(self.get_routed() or []):
            routed.add_metric([str(i)], float(count))
        yield routed


class ServerMetrics:
    """The server's registry; also the :class:`RequestObserver` of every request."""

    def __init__(self, get_engine_stats: Callable[[], list[dict[str, float]]] | None = None
                 ) -> None:
        self._get_engine_stats = get_engine_stats or list
        self._get_routed: Callable[[], list[int]] = list
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("lmkit_requests", "Requests by outcome (stop, length, abort, "
                                "error, rejected, invalid, refused).", ["outcome"], registry=r)
        self.ttft = Histogram("lmkit_time_to_first_token_seconds", "Time to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("lmkit_inter_token_latency_seconds",
                             "Time between consecutive output tokens.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("lmkit_e2e_request_latency_seconds", "Request latency, arrival "
                             "to last token.", buckets=_E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("lmkit_prompt_tokens", "Prompt tokens of finished "
                                     "requests.", registry=r)
        self.generation_tokens = Counter("lmkit_generation_tokens", "Generated tokens.",
                                         registry=r)
        self.engine_up = Gauge("lmkit_engine_up", "1 while the engine process runs and "
                               "serves, 0 while loading, restarting or dead.", registry=r)
        self.engine_restarts = Counter("lmkit_engine_restarts", "Times a dead engine "
                                       "process was restarted.", registry=r)
        r.register(EngineStatsCollector(  # type: ignore[arg-type]
            lambda: self._get_engine_stats(), lambda: self._get_routed()))

    def bind(self, get_engine_stats: Callable[[], list[dict[str, float]]],
             is_engine_up: Callable[[], bool],
             get_routed: Callable[[], list[int]] = list) -> None:
        """Read each engine's stats, whether they are all up, and the router's counts
        from the server (once it exists)."""
        self._get_engine_stats = get_engine_stats
        self._get_routed = get_routed
        self.engine_up.set_function(lambda: float(is_engine_up()))

    # RequestObserver
    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def on_tokens(self, num_tokens: int, inter_token_s: float) -> None:
        for _ in range(num_tokens):
            self.itl.observe(inter_token_s)

    def on_finish(self, outcome: str, e2e_s: float, num_prompt_tokens: int,
                  num_generated_tokens: int) -> None:
        self.requests.labels(outcome=outcome).inc()
        self.e2e.observe(e2e_s)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_generated_tokens)

    def count(self, outcome: str) -> None:
        """Count a request that never reached the engine (refused with 429, invalid)."""
        self.requests.labels(outcome=outcome).inc()

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
