"""The bench's pieces that need no fleet: the configurations, the worker-metrics scrape."""

from __future__ import annotations

from dataclasses import replace

import pytest
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from agentserving.replay.compare import scrape_worker_metrics, time_breakdown
from agentserving.replay.configs import (
    ABLATIONS,
    CONFIGS,
    DECODE_POD_ARGS,
    DECODE_POD_LONGCAP,
    DEFAULT_CONFIGS,
    VLLM_BLOCK_TOKENS,
    FleetSizes,
    fleet_spec,
    resolve,
    schedulers,
    without_shadow,
)
from agentserving.replay.fleet.topology import PortAllocator, build
from testkit.servers import ThreadedServer


def specs(engine: str, **kw):
    sizes = FleetSizes(engine=engine, prefill=1, decode=2, cpu_cache_gib=2.0,
                       disk_cache_gib=4.0, **kw)
    return {name: fleet_spec(CONFIGS[name], sizes) for name, c in CONFIGS.items()
            if engine in c.engines}


def test_the_reference_engines_configurations():
    s = specs("reference")
    base, cand, apc = s["baseline"], s["agentserving"], s["baseline-apc"]
    assert (base.both, base.prefill, base.decode) == (3, 0, 0)  # same worker count, no P/D
    assert base.routing == "round-robin" and base.disk_cache_gib == 0
    assert base.cpu_cache_gib * 1024 < 2  # < one 2 MiB chunk of the tiny model: no reuse
    assert (cand.prefill, cand.decode, cand.routing) == (1, 2, "kv-aware")
    assert cand.cpu_cache_gib == 2.0 and cand.disk_cache_gib == 4.0
    # each worker reuses only what it computed itself
    assert (apc.both, apc.prefill, apc.decode, apc.routing) == (3, 0, 0, "round-robin")
    assert apc.cpu_cache_gib == 2.0 and apc.disk_cache_gib == 0
    assert {sp.engine for sp in s.values()} == {"reference"}


def test_the_vllm_configurations_share_pods_and_device_kv(tmp_path):
    s = specs("vllm", device_kv_blocks=100)
    rr, session, cand, fcfs = (s[n] for n in ("vllm-rr", "vllm-session", "agentserving",
                                              "agentserving-fcfs"))
    assert (rr.routing, session.routing, cand.routing) == ("round-robin", "session", "kv-aware")
    for plain in (rr, session):  # stock vLLM: its own prefix cache, nothing else
        assert plain.both == 3 and plain.disk_cache_gib == 0
        assert plain.worker_args[-2:] == ["--vllm-kv-connector", "none"]
        assert plain.proxy_args == []
    assert (cand.prefill, cand.decode) == (1, 2) and cand.disk_cache_gib == 4.0
    for spec in s.values():
        assert spec.engine == "vllm" and spec.num_workers == 3
        flags = dict(zip(spec.worker_args[1::2], spec.worker_args[2::2], strict=False))
        assert flags["--kv-cache-blocks"] == "100"
        assert flags["--max-model-len"] == str(99 * VLLM_BLOCK_TOKENS)  # less vLLM's null block
    assert cand.role_args["prefill"] == ["--scheduler-policy",
                                         "longcap-dynamic?short_order=shortest&lookahead=5"]
    assert fcfs.role_args["prefill"] == ["--scheduler-policy", "fcfs"]  # the ablations
    assert s["agentserving-noprefetch"].role_args["prefill"] == [
        "--scheduler-policy", "longcap-dynamic?short_order=shortest"]  # the same, no lookahead
    assert "decode" not in cand.role_args  # the reference engine's decode-pod policy only
    # what report.json names per configuration
    assert schedulers(cand.role_args) == {
        "prefill": "longcap-dynamic?short_order=shortest&lookahead=5", "decode": "engine"}
    assert schedulers(fcfs.role_args) == {"prefill": "fcfs", "decode": "engine"}
    assert schedulers(s["vllm-rr"].role_args) == {"prefill": "engine", "decode": "engine"}
    # the layer-wise ablation: the same fleet, every pod's KV reload whole before the forward
    nolw = s["agentserving-nolayerwise"]
    assert cand.kv_layerwise_load and not nolw.kv_layerwise_load
    assert replace(nolw, kv_layerwise_load=True) == cand
    argv = [a for sp in build(nolw, tmp_path, PortAllocator()) if sp.role in ("prefill",
                                                                            "decode")
            for a in sp.argv]
    assert argv.count("--no-kv-layerwise-load") == 3
    assert "--no-kv-layerwise-load" not in [a for sp in build(cand, tmp_path / "c",
                                                              PortAllocator()) for a in sp.argv]
    # the disk tier reads the way the run asks (the main job: past the page cache)
    assert specs("vllm", disk_io="direct")["agentserving"].disk_io == "direct"
    # decode pods may run a prefill policy too; the fcfs ablation takes it out there, the
    # noprefetch one its shadow
    tuned = specs("vllm", decode_policy=DECODE_POD_LONGCAP)
    assert tuned["agentserving"].role_args["decode"] == ["--scheduler-policy", DECODE_POD_LONGCAP]
    assert tuned["agentserving-noprefetch"].role_args["decode"] == \
        tuned["agentserving"].role_args["decode"]
    d = specs("vllm", decode_policy="longcap-dynamic?lookahead=5")
    assert d["agentserving"].role_args["decode"] == ["--scheduler-policy",
                                                     "longcap-dynamic?lookahead=5"]
    assert "decode" not in d["agentserving-fcfs"].role_args  # vLLM's own everywhere
    assert d["agentserving-noprefetch"].role_args["decode"] == [
        "--scheduler-policy", "longcap-dynamic"]  # the same policy, without the shadow
    assert without_shadow("shadow?base=fcfs-chunk&lookahead=3&robust=0.5&chunk_tokens=512") \
        == "fcfs-chunk?chunk_tokens=512"
    assert without_shadow(DECODE_POD_LONGCAP) == DECODE_POD_LONGCAP
    assert without_shadow("shadow?lookahead=5") == "longcap-dynamic"
    # first turns may go local, and an idle prefill pod may keep a session
    assert cand.proxy_args == ["--admit-per-pod", "1", "--max-prefill-backlog", "1"]
    precise = s["vllm-precise"]
    assert (precise.both, precise.routing, precise.kv_events) == (3, "kv-aware", True)
    assert precise.chunk_size == VLLM_BLOCK_TOKENS  # the proxy looks up vLLM's own blocks
    assert precise.proxy_args == ["--prompt-hash-scheme", "vllm-sha256"]
    assert precise.worker_args[-2:] == ["--vllm-kv-connector", "none"]
    # llm-d's tiered guide: the same pods with LMCache's DRAM tier and no disk, each both
    # prefilling and decoding, llm-d's picker and none of agentserving's proxy additions
    llmd = s["llmd"]
    assert (llmd.both, llmd.prefill, llmd.decode, llmd.routing) == (3, 0, 0, "llm-d")
    assert (llmd.cpu_cache_gib, llmd.disk_cache_gib) == (cand.cpu_cache_gib, 0.0)
    assert "--vllm-kv-connector" not in llmd.worker_args and not llmd.kv_layerwise_load
    assert not llmd.role_args and not llmd.kv_events
    assert llmd.proxy_args[:2] == ["--prompt-hash-scheme", "lmcache-builtin"]
    assert {"--no-tool-pin", "--no-tool-prefetch", "--no-fork-placement"} <= set(
        llmd.proxy_args) and "1" not in llmd.proxy_args  # no admission, no backlog
    assert s["agentserving-toolpin"].proxy_args == [*cand.proxy_args, "--tool-pin"]
    assert s["agentserving-hold"].proxy_args == [*cand.proxy_args, "--announce-hold", "10",
                                                 "--queued-prefetch"]


def test_configurations_are_checked_against_the_engine():
    assert [c.name for c in resolve("", "vllm")] == list(DEFAULT_CONFIGS["vllm"]) == [
        "vllm-rr", "vllm-session", "vllm-precise", "llmd", "agentserving"]
    # --ablations: agentserving's ablations after the chosen ones, none twice
    assert [c.name for c in resolve("", "vllm", ablations=True)] == [
        *DEFAULT_CONFIGS["vllm"], *ABLATIONS["vllm"]]
    assert [c.name for c in resolve("vllm-rr,agentserving-fcfs,agentserving", "vllm",
                                    ablations=True)][:4] == [
        "vllm-rr", "agentserving-fcfs", "agentserving", "agentserving-noprefetch"]
    assert [c.name for c in resolve("baseline, agentserving", "reference")] == [
        "baseline", "agentserving"]
    with pytest.raises(ValueError, match="unknown configuration 'other'"):
        resolve("other", "vllm")
    with pytest.raises(ValueError, match="'vllm-rr' runs on vllm, not --engine reference"):
        resolve("vllm-rr", "reference")


def test_each_role_of_agentserving_gets_its_own_worker_and_proxy_flags(tmp_path):
    from agentserving.replay.fleet.topology import build

    sizes = FleetSizes(engine="reference", prefill=1, decode=2, disk_cache_gib=0.0,
                       worker_args=["--x"], prefill_policy="longcap-dynamic",
                       proxy_args=["--local-prefill-tokens=0"])
    argv = {p.name: p.argv for p in build(fleet_spec(CONFIGS["agentserving"], sizes), tmp_path)}
    assert argv["prefill-0"][-3:] == ["--x", "--scheduler-policy", "longcap-dynamic"]
    for name in ("decode-0", "decode-1"):  # they prefill short appends: decode-first steps
        assert argv[name][-len(DECODE_POD_ARGS) - 1:] == ["--x", *DECODE_POD_ARGS]
    assert argv["proxy"][-1] == "--local-prefill-tokens=0"
    base = build(fleet_spec(CONFIGS["baseline"], sizes), tmp_path)
    assert not any("--scheduler-policy" in p.argv for p in base)  # the engine's fcfs
    assert not any("--local-prefill-tokens=0" in p.argv for p in base)


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


def test_vllm_pods_metrics_become_the_breakdowns_names():
    from agentserving.replay.compare import from_vllm_metrics

    m = from_vllm_metrics({
        "prompt_tokens_total{engine=0,model_name=tiny}": 1000.0,
        "prompt_tokens_cached_total{engine=0,model_name=tiny}": 600.0,
        "request_prefill_time_seconds_sum{engine=0,model_name=tiny}": 1.5,
        "generation_tokens_total{engine=0,model_name=tiny}": 40.0,
        "generation_tokens_total{engine=1,model_name=tiny}": 2.0,
        "e2e_request_latency_seconds_count{engine=0,model_name=tiny}": 4.0})
    assert m == {"prefill_seconds_sum": 1.5, "completion_tokens_total": 42.0,
                 "request_seconds_count": 4.0, "computed_prompt_tokens_total": 400.0}


def test_per_turn_breakdown_splits_pd_and_colocated_time():
    from agentserving.replay.compare import per_turn_breakdown

    pd = per_turn_breakdown(
        {"prefill-0": {"request_seconds_sum": 4.0, "prefill_seconds_sum": 2.0,
                       "kv_load_seconds_sum": 1.0},
         "decode-0": {"kv_load_seconds_sum": 1.0, "decode_seconds_sum": 3.0,
                      "completion_tokens_total": 30, "prefill_seconds_sum": 0.4},
         "decode-1": {"decode_seconds_sum": 1.0, "completion_tokens_total": 10}},
        {"routing_seconds_sum": 0.002, "routing_seconds_count": 4,
         "routing_decisions_total{pod=decode-0,policy=kv-aware,stage=local}": 1.0,
         "routing_decisions_total{pod=prefill-0,policy=kv-aware,stage=prefill}": 3.0}, turns=4)
    assert pd == {"proxy_routing_ms": 0.5, "prefill_pod_s": 1.0, "prefill_compute_s": 0.6,
                  "kv_load_s": 0.5, "decode_compute_s": 1.0, "decode_per_token_s": 0.1,
                  "local_prefill_share": 0.25}
    both = per_turn_breakdown(
        {"worker-0": {"ttft_seconds_sum": 6.0, "request_seconds_sum": 9.0,
                      "prefill_seconds_sum": 5.0, "decode_seconds_sum": 2.0,
                      "completion_tokens_total": 20}}, {}, turns=2)
    assert both["prefill_pod_s"] == 3.0 and both["decode_per_token_s"] == 0.1
    assert both["proxy_routing_ms"] == 0.0


def test_configurations_that_differ_in_their_proxy_alone_share_one_fleet():
    from agentserving.replay.compare import fleet_groups
    from agentserving.replay.fleet.topology import same_pods

    s = specs("vllm")
    groups = fleet_groups([(n, s[n]) for n in (*DEFAULT_CONFIGS["vllm"], *ABLATIONS["vllm"])])
    assert [[n for n, _ in g] for g in groups] == [
        ["vllm-rr", "vllm-session", "vllm-precise"], ["llmd"], ["agentserving"],
        ["agentserving-fcfs"], ["agentserving-noprefetch"], ["agentserving-nolayerwise"],
        ["agentserving-allpd"], ["agentserving-noadmit"]]  # fresh fleets: see below
    assert same_pods(s["vllm-rr"], s["vllm-precise"])
    # the ablations' prefill pods differ
    assert not same_pods(s["agentserving"], s["agentserving-fcfs"])
    # allpd differs in its proxy alone, but the KV agentserving left in the tiers would warm it
    assert s["agentserving-allpd"].proxy_args[-4:] == ["--local-prefill-tokens", "0",
                                                      "--max-prefill-backlog", "0"]
    assert not same_pods(s["agentserving"], s["agentserving-allpd"])
    # admission at the proxy: the default's, and the ablation's flag after it, overriding it
    assert s["agentserving"].proxy_args[-4:-2] == ["--admit-per-pod", "1"]
    assert s["agentserving-noadmit"].proxy_args[-2:] == ["--admit-per-pod", "0"]
    # balanced placement: the proxy's flags, and the default's backlog rule overridden
    assert s["agentserving-balanced"].proxy_args[-4:] == ["--balance-tokens", "1024",
                                                          "--max-prefill-backlog", "0"]
    # only consecutive ones: a configuration between them starts a fleet of its own
    order = ["vllm-rr", "agentserving", "vllm-session"]
    assert len(fleet_groups([(n, s[n]) for n in order])) == 3
    ref = specs("reference")
    assert len(fleet_groups([(n, ref[n]) for n in ("baseline", "baseline-apc")])) == 2


def test_a_shared_fleets_counters_are_taken_per_configuration():
    from agentserving.replay.compare import metric_deltas

    assert metric_deltas({"prefill_seconds_sum": 5.0, "new": 2.0},
                         {"prefill_seconds_sum": 3.5}) == {"prefill_seconds_sum": 1.5,
                                                           "new": 2.0}
