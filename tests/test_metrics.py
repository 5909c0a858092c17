"""Tests for headstart.server.metrics: names in the exposition and counts that move."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from headstart.server.metrics import TTFT_BUCKETS, Metrics


def samples(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    body, _ = metrics.render()
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_render_lists_all_metrics():
    m = Metrics(slots=8)
    body, content_type = m.render()
    assert content_type.startswith("text/plain")
    text = body.decode()
    for name in (
        "headstart_requests_running",
        "headstart_requests_queued",
        "headstart_time_to_first_token_seconds",
        "headstart_inter_token_latency_seconds",
        "headstart_e2e_request_latency_seconds",
        "headstart_prompt_tokens_total",
        "headstart_cached_prompt_tokens_total",
        "headstart_generation_tokens_total",
        "headstart_requests_total",
        "headstart_request_errors_total",
        "headstart_slots_total",
    ):
        assert name in text, name
    assert samples(m)[("headstart_slots_total", ())] == 8


def test_separate_registries_do_not_collide():
    a, b = Metrics(), Metrics()
    a.error("invalid_request_error")
    assert ("headstart_request_errors_total", (("type", "invalid_request_error"),)) not in samples(
        b
    )


def test_request_lifecycle_updates_counts():
    m = Metrics(slots=4)
    m.request_queued()
    m.request_queued()
    s = samples(m)
    assert s[("headstart_requests_queued", ())] == 2
    m.request_started()
    s = samples(m)
    assert s[("headstart_requests_queued", ())] == 1
    assert s[("headstart_requests_running", ())] == 1
    m.first_token(0.003)
    m.token(0.02)
    m.token(0.03)
    m.request_finished(
        status=200,
        finish_reason="stop",
        prompt_tokens=100,
        completion_tokens=3,
        cached_tokens=64,
        duration_s=0.1,
    )
    s = samples(m)
    assert s[("headstart_requests_running", ())] == 0
    assert s[("headstart_time_to_first_token_seconds_count", ())] == 1
    assert s[("headstart_time_to_first_token_seconds_bucket", (("le", "0.005"),))] == 1
    assert s[("headstart_time_to_first_token_seconds_bucket", (("le", "0.0025"),))] == 0
    assert s[("headstart_inter_token_latency_seconds_count", ())] == 2
    assert s[("headstart_prompt_tokens_total", ())] == 100
    assert s[("headstart_cached_prompt_tokens_total", ())] == 64
    assert s[("headstart_generation_tokens_total", ())] == 3
    assert s[("headstart_requests_total", (("finish_reason", "stop"), ("status", "200")))] == 1
    assert s[("headstart_e2e_request_latency_seconds_count", ())] == 1


def test_failed_requests_and_errors():
    m = Metrics()
    m.request_finished(status=400, was_running=False)
    m.error("invalid_request_error")
    m.error("invalid_request_error")
    m.error("rate_limit_exceeded")
    s = samples(m)
    assert s[("headstart_requests_total", (("finish_reason", "none"), ("status", "400")))] == 1
    assert s[("headstart_request_errors_total", (("type", "invalid_request_error"),))] == 2
    assert s[("headstart_request_errors_total", (("type", "rate_limit_exceeded"),))] == 1
    assert s[("headstart_requests_running", ())] == 0


def test_set_load_and_buckets():
    m = Metrics()
    m.set_load(running=3, queued=7)
    m.set_slots(16)
    s = samples(m)
    assert s[("headstart_requests_running", ())] == 3
    assert s[("headstart_requests_queued", ())] == 7
    assert s[("headstart_slots_total", ())] == 16
    assert TTFT_BUCKETS[0] == 0.001 and TTFT_BUCKETS[-1] == 60.0


def test_prompt_cache_transfer_counters_are_exposed():
    """The host tier's restore and demotion figures, so a client computes bandwidth as the
    difference of bytes over the difference of seconds between two scrapes."""
    stats = {
        "cache_host_hits": 2,
        "cache_host_restored_bytes": 3 << 30,
        "cache_host_restore_seconds": 0.125,
        "cache_demoted_bytes": 5 << 20,
        "cache_demote_seconds": 0.5,
    }
    m = Metrics()
    m.watch_prompt_cache(lambda: stats)
    s = samples(m)
    assert s[("headstart_prompt_cache_host_hits_total", ())] == 2
    assert s[("headstart_prompt_cache_host_restored_bytes_total", ())] == 3 << 30
    assert s[("headstart_prompt_cache_host_restore_seconds_total", ())] == 0.125
    assert s[("headstart_prompt_cache_demoted_bytes_total", ())] == 5 << 20
    assert s[("headstart_prompt_cache_demote_seconds_total", ())] == 0.5
    stats["cache_host_restored_bytes"] += 1 << 30  # read at scrape time
    assert samples(m)[("headstart_prompt_cache_host_restored_bytes_total", ())] == 4 << 30
