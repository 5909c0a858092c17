"""Prometheus metrics for ``GET /metrics``.

:class:`Metrics` owns a dedicated ``CollectorRegistry`` (not prometheus_client's global one,
so tests and several servers in one process do not collide) holding the ``headstart_*``
metrics that vLLM / SGLang users look for under their own prefixes: running and queued
requests, time to first token and inter-token latency histograms, end-to-end latency, prompt /
cached / generated token counters, requests by status and finish reason, errors by type, and
the number of batch slots. Its small methods are what the app calls at each point of a
request's life; :meth:`Metrics.render` produces the exposition text. Non-goals: deciding when
those points happen (the app and engine do), multi-process aggregation, and per-request or
per-key labels (unbounded label values would blow up the series count).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["ITL_BUCKETS", "LATENCY_BUCKETS", "TTFT_BUCKETS", "Metrics"]

#: Time to first token: 1 ms (a cached prefix) up to 60 s (a long cold prompt on a busy server).
TTFT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    60.0,
)
#: Gap between tokens of one stream: sub-millisecond (speculative bursts) up to stalls.
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)
#: Whole-request latency.
LATENCY_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
)


class Metrics:
    """The server's metrics, in their own registry.

    Request lifecycle: :meth:`request_queued` when accepted, :meth:`request_started` when it
    gets a slot, :meth:`first_token` / :meth:`token` as tokens stream out,
    :meth:`request_finished` at the end (success or failure), and :meth:`error` for every
    error answered (including rejected requests that never queued). :meth:`set_load` may
    instead set the two gauges from the scheduler's own counts. All methods are thread-safe.
    """

    def __init__(self, *, slots: int = 0, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests_running = Gauge(
            "headstart_requests_running", "Requests currently generating.", registry=r
        )
        self.requests_queued = Gauge(
            "headstart_requests_queued", "Requests waiting for a slot.", registry=r
        )
        self.slots_total = Gauge(
            "headstart_slots_total", "Concurrent sequence slots of the engine.", registry=r
        )
        self.time_to_first_token = Histogram(
            "headstart_time_to_first_token_seconds",
            "Time from request arrival to its first generated token.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "headstart_inter_token_latency_seconds",
            "Time between consecutive generated tokens of one sequence.",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.request_latency = Histogram(
            "headstart_e2e_request_latency_seconds",
            "Time from request arrival to its last byte.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "headstart_prompt_tokens_total", "Prompt tokens of finished requests.", registry=r
        )
        self.cached_prompt_tokens = Counter(
            "headstart_cached_prompt_tokens_total",
            "Prompt tokens served from the prefix cache instead of being computed.",
            registry=r,
        )
        self.generation_tokens = Counter(
            "headstart_generation_tokens_total", "Generated tokens.", registry=r
        )
        self.requests = Counter(
            "headstart_requests_total",
            "Finished requests by HTTP status and finish reason.",
            ["status", "finish_reason"],
            registry=r,
        )
        self.request_errors = Counter(
            "headstart_request_errors_total",
            "Errors answered, by error type.",
            ["type"],
            registry=r,
        )
        self.slots_total.set(slots)

    def watch_prompt_cache(self, stats: Callable[[], Mapping[str, float]]) -> None:
        """Export the engine's prompt-cache counters, read from ``stats()`` at scrape time."""
        self.registry.register(_PromptCacheCollector(stats))

    def set_slots(self, slots: int) -> None:
        """Set the number of concurrent sequence slots."""
        self.slots_total.set(slots)

    def set_load(self, running: int, queued: int) -> None:
        """Set the running / queued gauges from authoritative counts."""
        self.requests_running.set(running)
        self.requests_queued.set(queued)

    def request_queued(self) -> None:
        """A request was accepted and waits for a slot."""
        self.requests_queued.inc()

    def request_started(self, *, was_queued: bool = True) -> None:
        """A request got a slot (``was_queued``: it had been counted by request_queued)."""
        if was_queued:
            self.requests_queued.dec()
        self.requests_running.inc()

    def first_token(self, ttft_s: float) -> None:
        """Record a time to first token, in seconds."""
        self.time_to_first_token.observe(ttft_s)

    def token(self, itl_s: float) -> None:
        """Record the gap before one more generated token, in seconds."""
        self.inter_token_latency.observe(itl_s)

    def request_finished(
        self,
        *,
        status: int,
        finish_reason: str | None = None,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        cached_tokens: int = 0,
        duration_s: float | None = None,
        was_running: bool = True,
    ) -> None:
        """A request ended. ``was_running``: it had been counted by request_started (a
        request that failed while queued passes False after leaving the queue itself)."""
        if was_running:
            self.requests_running.dec()
        self.requests.labels(status=str(status), finish_reason=finish_reason or "none").inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_prompt_tokens.inc(cached_tokens)
        self.generation_tokens.inc(completion_tokens)
        if duration_s is not None:
            self.request_latency.observe(duration_s)

    def error(self, type: str) -> None:
        """Count an error answered to a client, by its API error type."""
        self.request_errors.labels(type=type).inc()

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type, for ``GET /metrics``."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _PromptCacheCollector(Collector):
    """Prompt-cache figures owned by the engine thread, read when /metrics is scraped."""

    _COUNTERS: ClassVar[dict[str, tuple[str, str]]] = {
        "cache_hits": ("headstart_prompt_cache_hits", "Prompt-cache lookups that found a prefix."),
        "cache_misses": ("headstart_prompt_cache_misses", "Prompt-cache lookups that found none."),
        "cache_restored_tokens": (
            "headstart_prompt_cache_restored_tokens",
            "Prompt tokens restored from snapshots.",
        ),
        "cache_evictions": (
            "headstart_prompt_cache_evictions",
            "Snapshots evicted to stay within the byte budget.",
        ),
        "cache_failed_restores": (
            "headstart_prompt_cache_failed_restores",
            "Restores abandoned for a full prefill.",
        ),
        "cache_host_hits": (
            "headstart_prompt_cache_host_hits",
            "Lookups answered from the host-memory tier.",
        ),
        # Restore bandwidth from the host tier = restored bytes / restore seconds (both
        # differences between two scrapes); the same for demotions.
        "cache_host_restored_bytes": (
            "headstart_prompt_cache_host_restored_bytes",
            "Bytes copied from host-tier snapshots to the device by restores.",
        ),
        "cache_host_restore_seconds": (
            "headstart_prompt_cache_host_restore_seconds",
            "Wall seconds of restores from the host tier, until their copies landed.",
        ),
        "cache_demoted_bytes": (
            "headstart_prompt_cache_demoted_bytes",
            "Bytes copied to host memory by snapshots demoted from the device tier.",
        ),
        "cache_demote_seconds": (
            "headstart_prompt_cache_demote_seconds",
            "Wall seconds of device-to-host copies of demoted snapshots, until they landed.",
        ),
        "cache_seams": (
            "headstart_prompt_cache_seams",
            "Prompts extending a cached generation's prompt whose answer tokens differed "
            "from the generated ones (restored up to where they agree).",
        ),
        "cache_restores_in_place": (
            "headstart_prompt_cache_restores_in_place",
            "Restores whose state the stream's slot still held (a conversation's next turn "
            "in the slot of its last): nothing copied.",
        ),
        "spec_rounds": ("headstart_spec_decode_rounds", "Verify windows run."),
        "spec_drafted": ("headstart_spec_decode_draft_tokens", "Draft tokens proposed."),
        "spec_accepted": ("headstart_spec_decode_accepted_tokens", "Draft tokens accepted."),
    }
    _GAUGES: ClassVar[dict[str, tuple[str, str]]] = {
        "cache_bytes": ("headstart_prompt_cache_bytes", "Bytes held by snapshots."),
        "cache_budget_bytes": ("headstart_prompt_cache_budget_bytes", "Snapshot byte budget."),
        "cache_entries": ("headstart_prompt_cache_entries", "Snapshots held."),
        "cache_host_bytes": (
            "headstart_prompt_cache_host_bytes",
            "Bytes held by snapshots in host memory.",
        ),
        "cache_demotions_pending": (
            "headstart_prompt_cache_demotions_pending",
            "Snapshots being copied to the host tier.",
        ),
    }

    def __init__(self, stats: Callable[[], Mapping[str, float]]) -> None:
        self._stats = stats

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        stats = self._stats()
        for key, (name, doc) in self._COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=stats.get(key, 0))
        for key, (name, doc) in self._GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=stats.get(key, 0))
        rounds = stats.get("spec_rounds", 0)
        # Tokens emitted per verify window: accepted drafts plus the target's own token.
        yield GaugeMetricFamily(
            "headstart_spec_decode_mean_accepted_length",
            "Mean tokens emitted per verify window (accepted drafts + 1); 0 before any.",
            value=(stats.get("spec_accepted", 0) / rounds + 1) if rounds else 0.0,
        )
