"""Simulator tests: event ordering, an exact hand-computed scenario, real policy objects,
determinism, and the CLI."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from agentserving.core.schemas import PodRole
from agentserving.proxy.routing import Candidate, KvAware, RouteInput
from agentserving.replay.ideal import ideal_hit
from agentserving.replay.loader import load_trace
from agentserving.replay.stats import trace_stats
from agentserving.replay.trace import resolve_all, sessions_from
from agentserving.sim import SimConfig, load_profile, simulate
from agentserving.sim.cluster import Cluster, parse_topology, weighted_percentile
from agentserving.sim.events import EventLoop
from agentserving.sim.workload import SimSession, compile_trace
from testkit.sim import toy_profile


def test_event_order_time_then_fifo_and_cancel():
    loop, seen = EventLoop(), []
    loop.at(2.0, seen.append, "c")
    loop.at(1.0, seen.append, "a")
    loop.at(1.0, seen.append, "b")          # same time: scheduling order
    ev = loop.at(1.5, seen.append, "x")
    ev.cancel()
    loop.at(0.5, lambda: loop.after(0.0, seen.append, "z"))
    loop.run()
    assert seen == ["z", "a", "b", "c"]
    assert loop.now == 2.0
    with pytest.raises(ValueError):
        loop.at(1.0, seen.append, "past")


def test_topology_parsing():
    assert parse_topology("1P3D") == (1, 3, 0)
    assert parse_topology("4x1") == (0, 0, 4)
    with pytest.raises(ValueError):
        parse_topology("3Q")


def test_hand_computed_single_turn_exact_latency():
    # one turn: 1000-token prompt, 11 output tokens, one `both` pod, no reuse
    # prefill: 0.1 + 0.001*1000 = 1.1 s (first token); then 10 decode steps of 0.01 s
    trace = sessions_from([{"session_id": "s", "start_s": 0.0, "turns": [
        {"input": {"length": 1000}, "output_tokens": 11}]}])
    res = simulate(compile_trace(trace), toy_profile(),
                   SimConfig(config="baseline", topology="1x1", baseline_policy="fcfs-nochunk"))
    (rec,) = res.records
    assert rec["ttft_s"] == pytest.approx(1.1)
    assert rec["e2e_s"] == pytest.approx(1.2)
    assert res.summary["itl_p99_s"] == pytest.approx(0.01)


def test_hand_computed_pd_handoff_and_reuse():
    # 1P1D, two turns of one session; transfer 1000 B/token at 1 GB/s
    trace = sessions_from([{"session_id": "s", "start_s": 0.0, "turns": [
        {"input": {"length": 1024}, "output_tokens": 2, "tool_gap_s": 1.0},
        {"input": {"length": 100}, "output_tokens": 2}]}], block_size=256)
    res = simulate(compile_trace(trace), toy_profile(),
                   SimConfig(config="agentserving", topology="1P1D", shadow=False,
                             policy="fcfs-nochunk"))
    r0, r1 = sorted(res.records, key=lambda r: r["turn"])
    # prefill 0.1 + 1.024 s, hand-off of 1024 tokens, then the decode pod's first step (0.01 s)
    # answers the first token and the second (as the engine's first remote decode does)
    assert r0["ttft_s"] == pytest.approx(0.1 + 1.024 + 1024e3 / 1e9 + 0.01)
    assert r0["e2e_s"] == pytest.approx(r0["ttft_s"])
    # turn 1: prompt 1024 + 2 + 100 = 1126; the 4 chunks of turn 0's prompt sit in the
    # prefill pod's DRAM (no device cache): 1024 cached, 102 computed, 4 chunks loaded. The
    # decode pod kept turn 0's 4 chunks too: it pulls only the 102-token suffix and loads
    # its 4 chunks from its own DRAM during its first step.
    assert r1["cached_tokens"] == 1024
    load = 4 * 256 * 1000 / 1e9
    assert r1["ttft_s"] == pytest.approx(0.1 + 0.102 + load + 102e3 / 1e9 + 0.01 + load)
    assert r1["decode_pod"] == r0["decode_pod"]
    assert res.summary["sim"]["pod_to_pod_bytes"] == (1024 + 102) * 1000


def test_routing_matches_proxy_policy_on_same_inputs():
    trace = load_trace("bundled:bench-small")
    cluster = Cluster(compile_trace(trace), load_profile("910b3-qwen3-4b"),
                      SimConfig(config="agentserving", topology="3P1D"))
    pods = cluster.prefill_pods
    # give pod prefill-1 a cached prefix in the index; the sim's route must agree with a
    # fresh KvAware over the same inputs
    chunks = cluster.sessions[0].turns[0].stored_chunks
    pods[1].tiers.store(chunks[:3])
    cluster.flush(pods[1])
    from agentserving.sim.events import run_sync
    cluster.session("sX").chunk_hashes = chunks   # what the proxy keeps after a turn
    chosen, prefix = cluster.route("sX", cluster.sessions[0].turns[0])
    found = run_sync(cluster.index.lookup(chunks, role=PodRole.PREFILL))
    from agentserving.kvindex.index.base import rank_prefixes
    prefixes = {p.pod: p for p in rank_prefixes(found)}
    expect = KvAware().rank(RouteInput("sX", [Candidate(p.name, p.name, 0) for p in pods],
                                       prefixes))[0].name
    assert chosen.name == expect == "prefill-1" and prefix == 3
    assert cluster.stats["lookups"] == 1


def test_a_branch_first_turn_routes_where_its_parents_chunks_are():
    """The proxy's fork (``SessionState.fork_from``): a branch's first turn is looked up with
    its parent's chunks and goes to the pod holding them."""
    cluster = Cluster(compile_trace(load_trace("bundled:bench-small")),
                      load_profile("910b3-qwen3-4b"),
                      SimConfig(config="agentserving", topology="3P1D"))
    pods = cluster.prefill_pods
    parent = cluster.sessions[0]
    chunks = parent.turns[0].stored_chunks
    pods[2].tiers.store(chunks[:4])
    cluster.flush(pods[2])
    cluster.session(parent.session_id).chunk_hashes = chunks   # after the parent's turn
    branch = SimSession("branch", (parent.session_id, 0, 0.0), 0.0, parent.turns)
    cluster.start_turn(branch, 0)
    state = cluster.session("branch")
    assert cluster.stats["lookups"] == 1 and state.chunk_hashes == chunks
    assert state.last_pod == "prefill-2"


def test_simulator_runs_real_policy_objects():
    from agentserving.prefill.policies import LongcapDynamic
    from agentserving.prefill.shadow import ShadowScheduler
    cluster = Cluster(compile_trace(load_trace("bundled:bench-small")),
                      load_profile("910b3-qwen3-4b"), SimConfig(topology="1P2D"))
    pol = cluster.pods["prefill-0"].policy
    assert isinstance(pol, ShadowScheduler) and isinstance(pol.policy, LongcapDynamic)
    res = cluster.run()
    assert res.summary["turns_completed"] == 95
    assert 0.9 < res.summary["hit_vs_ideal"] <= 1.0


@pytest.mark.parametrize("workload", ["bundled:bench-small", "bundled:agent-mix"])
def test_compiled_ideal_matches_replay_ideal(workload):
    trace = load_trace(workload)  # agent-mix: shared blocks after a task (parts inputs)
    ss = compile_trace(trace)
    ideal = sum(t.ideal_cached for s in ss for t in s.turns) / sum(
        t.prompt_len for s in ss for t in s.turns)
    assert ideal == pytest.approx(trace_stats(trace)["ideal_hit_rate"], abs=1e-4)


def test_shared_parts_compile_to_the_same_chunks():
    def session(sid: str) -> dict:
        return {"session_id": sid, "turns": [{"input": {"parts": [
            {"length": 40, "block_ids": ["sys/0", "sys/1", "sys/2"]}, {"length": 5},
            {"length": 16, "block_ids": ["post/0"]}]}, "output_tokens": 2}]}

    trace = sessions_from([session("a"), session("b")], block_size=16)
    a, b = compile_trace(trace, chunk=16)
    assert a.turns[0].prompt_len == 61 and a.turns[0].chunks[:2] == b.turns[0].chunks[:2]
    assert a.turns[0].chunks[2:] != b.turns[0].chunks[2:]  # after each session's own tokens
    assert b.turns[0].ideal_cached == 32 == ideal_hit(resolve_all(trace), chunk_size=16
                                                      ).per_turn[("b", 0)]


def test_deterministic():
    trace = load_trace("bundled:bench-small")
    prof = load_profile("h100-llama8b")
    a = simulate(compile_trace(trace), prof, SimConfig(rate=3.0, seed=5)).summary
    b = simulate(compile_trace(trace), prof, SimConfig(rate=3.0, seed=5)).summary
    c = simulate(compile_trace(trace), prof, SimConfig(rate=3.0, seed=6)).summary
    strip = lambda s: {k: v for k, v in s.items() if k != "sim"}  # noqa: E731
    assert strip(a) == strip(b)
    assert strip(a) != strip(c)


def test_weighted_percentile():
    assert weighted_percentile([(1.0, 98), (5.0, 2)], 99) == 5.0
    assert weighted_percentile([(1.0, 99), (5.0, 1)], 50) == 1.0
    assert weighted_percentile([], 99) is None


def test_cli_writes_report(tmp_path):
    from agentserving.sim.cli import command
    out = tmp_path / "run"
    res = CliRunner().invoke(command, ["--profile", "910b3-qwen3-4b", "--topology", "1P2D",
                                       "--out", str(out), "--no-plots"])
    assert res.exit_code == 0, res.output
    report = json.loads((out / "report.json").read_text())
    assert set(report["configs"]) == {"baseline", "agentserving"}
    assert report["ratios"]["req_per_s"] is not None
    assert "occupancy_bytes_cpu" in report["timeseries"]["agentserving"]
    assert report["configs"]["agentserving"]["prefix_hit_rate"] > 0.5


def test_cli_local_prefill_tokens_reaches_the_simulated_proxy(tmp_path):
    from agentserving.sim.cli import command
    out = tmp_path / "run"
    res = CliRunner().invoke(command, ["--profile", "reference-cpu", "--topology", "1P2D",
                                       "--configs", "agentserving", "--engine-scheduler",
                                       "--local-prefill-tokens", "2048", "--limit", "4",
                                       "--max-prefill-backlog", "5",
                                       "--out", str(out), "--no-plots"])
    assert res.exit_code == 0, res.output
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["local_prefill_tokens"] == 2048
    assert report["settings"]["max_prefill_backlog"] == 5
    turns = [json.loads(line) for line in
             (out / "agentserving" / "turns.jsonl").read_text().splitlines()]
    assert any(t["prefill_pod"].startswith("decode-") for t in turns)  # whole on decode pods
