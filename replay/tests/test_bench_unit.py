"""The bench's pieces that need no fleet: the two configurations, the worker-metrics scrape."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from agentserving.core.testing import ThreadedServer
from agentserving.replay.bench import fleet_spec, scrape_worker_metrics, time_breakdown


def test_the_two_configurations():
    kw = dict(prefill=1, decode=2, model="tiny", cpu_cache_gib=2.0, disk_cache_gib=4.0,
              worker_args=[], worker_env={}, startup_timeout_s=60)
    base, cand = fleet_spec("baseline", **kw), fleet_spec("agentserving", **kw)
    assert (base.both, base.prefill, base.decode) == (3, 0, 0)  # same worker count, no P/D
    assert base.routing == "round-robin" and base.disk_cache_gib == 0
    assert base.cpu_cache_gib * 1024 < 2  # < one 2 MiB chunk of the tiny model: no reuse
    assert (cand.prefill, cand.decode, cand.routing) == (1, 2, "kv-aware")
    assert cand.cpu_cache_gib == 2.0 and cand.disk_cache_gib == 4.0
    with pytest.raises(Exception, match="unknown configuration"):
        fleet_spec("other", **kw)


def test_worker_metrics_are_scraped_and_summarised():
    registry = CollectorRegistry()
    prefill = Histogram("agentserving_worker_prefill_seconds", "x", registry=registry)
    requests = Histogram("agentserving_worker_request_seconds", "x", registry=registry)
    moved = Counter("agentserving_worker_transfer_bytes", "x", ["direction"], registry=registry)
    Counter("other_thing", "not ours", registry=registry).inc()
    prefill.observe(1.5)
    prefill.observe(0.5)
    requests.observe(3.0)
    moved.labels("sent").inc(5e6)
    app = FastAPI()

    @app.get("/metrics")
    def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(registry).decode())

    server = ThreadedServer(app)
    try:
        m = scrape_worker_metrics(server.url)
        missing = scrape_worker_metrics(server.url + "/nothing")
    finally:
        server.stop()
    assert m["prefill_seconds_sum"] == 2.0 and m["prefill_seconds_count"] == 2
    assert m["transfer_bytes_total{direction=sent}"] == 5e6
    assert not any(k.startswith("other") or k.endswith("_bucket") for k in m)
    assert missing == {}
    (line,) = time_breakdown({"prefill-0": m})
    assert line.startswith("prefill-0: prefill 2.0s") and "over 1 requests" in line
    assert "hand-off 5 MB" in line
