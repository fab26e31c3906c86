"""The simulator's speed-ups change no result: a golden fingerprint of small runs taken before
them, the shadow's short look-ahead vs the full one, and netted index event batches vs the raw
event sequence."""

from __future__ import annotations

import hashlib
import json

import pytest

from agentserving.core.schemas import EventBatch, PodRegistration, PodRole, Tier
from agentserving.kvindex.index.base import rank_prefixes
from agentserving.kvindex.index.memory import InMemoryIndex
from agentserving.replay.synthetic import generate_preset
from agentserving.sim import SimConfig, load_profile, simulate
from agentserving.sim.events import run_sync
from agentserving.sim.tiers import PodTiers
from agentserving.sim.workload import compile_trace

TIMING = {"wall_s", "lookup_s", "index_apply_s"}   # wall-clock measurements
ADDED = {"index_chunk_ops", "forward_s", "forward_s_by_role", "decode_ttft_s",
         "host_busy_core_s"}                        # stats added after the fingerprints
ADDED_SUMMARY = {"by_source", "short_turns", "ttft_p50_short_s", "ttft_p85_short_s",
                 "after_gap_turns", "ttft_p50_after_gap_s", "after_human_pause_turns",
                 "ttft_p50_after_human_pause_s", "branch_starts", "branch_start_ttft_p90_s",
                 "mean_jct_s", "sourced_turns", "prompt_sources", "kv_load_s", "disk_read_s",
                 "fell_back_turns", "announced_turns", "announced_on_disk_turns",
                 "disk_read_turns", "disk_read_critical_s"}  # the replay summary's, likewise

# sha256 of `fingerprint` for generate_preset("agent", sessions=150), taken with the simulator
# as it was before model_construct / netted flushes / the short shadow look-ahead / shallow
# session copies. A deliberate change to what the simulator models changes these: re-take them
# (print fingerprint(...) for each case) and say why in the commit.
# Re-taken for the agentserving cases when the model followed the P/D change (a16cf9c): decode
# pods keep a pulled prompt's chunks and pull only the new suffix next turn, the proxy's
# decode choice prefers the session's last decode pod, and a P/D turn's first token comes
# from the decode pod's first step; a decode pod writes only the chunks after the prefix it
# held (as the engine's _store_remote); a hit in the tier a chunk would land in anyway sends
# no residency event (records, summary and time series unchanged by that: only the event
# counts in `sim` moved). The speed-ups below (index, tiers, shadow, decode choice) left these
# unchanged; the baseline's is the original. Re-taken again when the simulator's memory of a
# session became the proxy's own SessionState: a branch's first turn now starts from its
# parent's chunks and pods (``fork_from``, the proxy's fork), where the simulator had routed it
# with none (15 of the 165 sessions are branches; 2P6D hit vs ideal 0.956 -> 0.967). With the
# fork copy left out the old values come back exactly.
GOLDEN = {
    ("910b3-qwen3-4b", "1P3D", 5.0, "agentserving"):
        "3d41615d88adc3045bb99cdd1523c321eab9aa8ec626eb7298f83795ee2c3598",
    ("h200-llama8b", "2P6D", 8.0, "agentserving"):
        "5d127f8a5d18ec4a21a45d3cde8f419c80c6f5af233946f80e5af7f2ecc51b1b",
    ("h200-llama8b", "2P6D", 8.0, "baseline"):
        "afcbe75c72c22a1ed3a3aad721dd172f2b8a72f178eab24dc311e255f8cdfc20",
}


def fingerprint(res) -> str:
    sim = {k: v for k, v in res.summary["sim"].items() if k not in TIMING | ADDED}
    summary = {k: v for k, v in res.summary.items() if k != "sim" and k not in ADDED_SUMMARY}
    doc = {"summary": summary, "sim": sim,
           "records": res.records, "timeseries": res.timeseries, "pods": res.stats["pods"]}
    # the same bytes as the reference script: json of the JSON-decoded document
    doc = json.loads(json.dumps(doc, default=str))
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


@pytest.fixture(scope="module")
def trace():
    return generate_preset("agent", sessions=150)


@pytest.mark.parametrize("case", sorted(GOLDEN))
def test_results_match_pre_optimization_golden(trace, case):
    prof, topo, rate, name = case
    res = simulate(compile_trace(trace), load_profile(prof),
                   SimConfig(config=name, topology=topo, rate=rate))
    assert fingerprint(res) == GOLDEN[case]


def test_short_shadow_lookahead_changes_nothing(trace):
    prof = load_profile("h200-llama8b")
    # a small DRAM tier, so that prefixes spill to disk and the N+1 prefetch runs
    prof = prof.model_copy(update={"memory": prof.memory.model_copy(update={"dram_gib": 1.0})})
    ss = compile_trace(trace)
    short = simulate(ss, prof, SimConfig(topology="1P3D", rate=4.0))
    full = simulate(ss, prof, SimConfig(topology="1P3D", rate=4.0, full_lookahead=True))
    assert short.summary["sim"]["prefetch_chunks"] > 0   # the prefetch path is exercised
    assert fingerprint(short) == fingerprint(full)
    # taken when the pods' prefetch landed through PodTiers.prefetch on a loop event, before
    # the pods' reads went through DiskReads (the scheduling study's disk queue)
    assert fingerprint(short) == PREFETCH_GOLDEN


PREFETCH_GOLDEN = "6dcdd92be5d91686c2d3b92a7271f0e234eb630b20c637ff90f34637048a8b86"


def test_simulate_leaves_callers_sessions_alone(trace):
    ss = compile_trace(trace)
    starts = [s.start_s for s in ss]
    a = simulate(ss, load_profile("h200-llama8b"), SimConfig(topology="1P1D", rate=3.0))
    assert [s.start_s for s in ss] == starts
    b = simulate(ss, load_profile("h200-llama8b"), SimConfig(topology="1P1D", rate=3.0))
    assert fingerprint(a) == fingerprint(b)


def _raw_replay(index: InMemoryIndex, pod: str, ops: list[tuple], first_seq: int) -> None:
    """Apply each residency change as its own validated one-chunk event batch."""
    for seq, (op, tier, h) in enumerate(ops, start=first_seq):
        run_sync(index.apply_events(EventBatch.model_validate(
            {"pod": pod, "seq": seq, "events": [{"op": op, "tier": tier,
                                                  "chunk_hashes": [h]}]})))


def test_netted_flush_leaves_index_as_raw_events_would():
    caps = {Tier.DEVICE: 3, Tier.CPU: 4, Tier.DISK: 5}
    ops: list[tuple] = []

    t = PodTiers("p0", caps, 1024, log=ops)   # records the raw sequence too
    netted, raw = InMemoryIndex(), InMemoryIndex()
    for ix in (netted, raw):
        run_sync(ix.register_pod(PodRegistration(pod="p0", memory_api_url="http://p0:6999",
                                                 role=PodRole.PREFILL, model="m"), ttl_s=1e9))
    chains = [[f"{i:x}0{j:x}" for j in range(8)] for i in range(6)]
    seq_raw = 0
    for step in range(60):
        chain = chains[step % len(chains)]
        if step % 3 == 0:
            t.store(chain[: 3 + step % 5])
        elif step % 3 == 1:
            t.use(chain[:4])
        else:
            t.prefetch(chain)
        n_raw = len(ops)
        batch = t.flush()
        if batch is None:
            continue
        # the constructed batch is one validation would accept
        assert EventBatch.model_validate(batch.model_dump()) == batch
        run_sync(netted.apply_events(batch))
        _raw_replay(raw, "p0", ops[seq_raw:n_raw], first_seq=seq_raw + 1)
        seq_raw = n_raw
        assert t.raw_events == len(ops)
        for chain_q in chains:
            a = rank_prefixes(run_sync(netted.lookup(chain_q)))
            b = rank_prefixes(run_sync(raw.lookup(chain_q)))
            assert a == b
        assert netted._pods["p0"].chunks == raw._pods["p0"].chunks
        assert netted._pods["p0"].counts == raw._pods["p0"].counts


def test_decode_choice_among_least_loaded_is_the_proxys():
    """Cluster.prefill_done ranks only the least-loaded decode pods with the proxy's
    LeastLoaded: its first choice over all candidates is always one of them."""
    import random

    from agentserving.proxy.routing import Candidate, LeastLoaded, RouteInput

    rng, policy = random.Random(0), LeastLoaded()
    for _ in range(2000):
        cands = [Candidate(f"decode-{j}", f"decode-{j}", rng.randrange(3))
                 for j in range(rng.randrange(1, 50))]
        last = rng.choice([None, *[c.name for c in cands]])
        sid = f"s{rng.randrange(10**6)}"
        least = min(c.inflight for c in cands)
        full = policy.rank(RouteInput(sid, cands, last_pod=last))[0]
        sub = policy.rank(RouteInput(sid, [c for c in cands if c.inflight == least],
                                     last_pod=last))[0]
        assert full.name == sub.name


def test_incremental_waiting_queue_matches_a_rebuild(trace, monkeypatch):
    """The prefill queue's views and disk count are kept incrementally (no per-step rebuild):
    at every step of a saturated run (queues build up) they equal a rebuild from the queue."""
    from agentserving.sim import cluster as C

    orig = C.Pod._state
    checked = {"steps": 0, "max_queue": 0, "disk": 0}

    def state(self):
        st = orig(self)
        fresh = tuple(r.view for r in self.waiting.values())
        assert st.waiting == fresh
        assert [v.req_id for v in st.waiting] == list(self.waiting)
        assert self._wdisk == sum(1 for v in fresh if v.disk_chunks)
        checked["steps"] += 1
        checked["max_queue"] = max(checked["max_queue"], len(fresh))
        checked["disk"] += bool(self._wdisk)
        return st

    monkeypatch.setattr(C.Pod, "_state", state)
    prof = load_profile("h200-llama8b")
    prof = prof.model_copy(update={"memory": prof.memory.model_copy(update={"dram_gib": 1.0})})
    simulate(compile_trace(trace), prof, SimConfig(topology="1P3D", rate=20.0))
    assert checked["steps"] > 100
    assert checked["max_queue"] >= 10    # the queue did build up
    assert checked["disk"] > 0           # and the disk-chunk count was exercised


def test_kept_inflight_counts_match_the_queues(trace, monkeypatch):
    """Routing reads each pod's kept ``n_inflight``; it equals the queues' sizes whenever a
    turn is routed, and every pod ends at zero (P/D, both pods and the engine scheduler)."""
    from agentserving.sim.cluster import Cluster

    seen: list[Cluster] = []
    busiest = [0]
    route = Cluster.route

    def checked(self, session_id, turn):  # noqa: ANN001
        for p in self.pods.values():
            assert p.n_inflight == p.inflight
            busiest[0] = max(busiest[0], p.inflight)
        seen.append(self)
        return route(self, session_id, turn)

    monkeypatch.setattr(Cluster, "route", checked)
    ss = compile_trace(trace)
    for name, topo, kw in (("agentserving", "1P3D", {}), ("baseline", "1P3D", {}),
                           ("agentserving", "1P1D", {"engine_scheduler": True})):
        seen.clear()
        busiest[0] = 0
        prof = "reference-cpu" if kw else "910b3-qwen3-4b"
        simulate(ss[:60], load_profile(prof), SimConfig(config=name, topology=topo, rate=5.0,
                                                        **kw))
        assert len(seen) > 100 and max(p.inflight for p in seen[-1].pods.values()) == 0
        assert all(p.n_inflight == 0 for p in seen[-1].pods.values())
        assert busiest[0] > 1   # pods were loaded while routed to


# sha256 of `_tiers_script` run on sim/tiers.py as it was before its per-change paths were
# flattened (the recursive eviction cascade): every result, event batch, counter and LRU order
TIERS_GOLDEN = "195043a1f3798b15f7520d55d4fa9222c1837cdd4ecae85744b03062d3437b88"


def _tiers_script() -> str:
    import random

    rng = random.Random(7)
    out = []
    for caps in ({Tier.DEVICE: 3, Tier.CPU: 5, Tier.DISK: 7},
                 {Tier.DEVICE: 0, Tier.CPU: 4, Tier.DISK: 6},     # decode pod: DRAM on top
                 {Tier.DEVICE: 4, Tier.CPU: 0, Tier.DISK: 5},     # no DRAM: victims dropped
                 {Tier.DEVICE: 2, Tier.CPU: 3, Tier.DISK: 0}):
        t = PodTiers("p", caps, 100)
        for _ in range(400):
            chain = [f"c{rng.randrange(30)}" for _ in range(rng.randrange(1, 9))]
            op = rng.randrange(4)
            if op == 0:
                r = t.store(chain)
            elif op == 1:
                r = t.store_new(chain)
            elif op == 2:
                r = sorted((k.value, v) for k, v in t.use(chain).items())
            else:
                r = t.prefetch(chain)
            for k in (0, 3, 9):
                assert t.prefix_len(chain, k) == t.prefix(chain, k)[0]
            b = t.flush()
            ev = [(e.op.value, e.tier.value, e.chunk_hashes) for e in b.events] if b else None
            out.append([r if op != 0 else None, ev, t.raw_events, sorted(t.moved.items()),
                        {k.value: list(v) for k, v in t.lru.items()},
                        t.prefix(chain, 5)[0], [x.value for x in t.prefix(chain, 5)[1]]])
    return hashlib.sha256(json.dumps(out).encode()).hexdigest()


def test_tiers_change_exactly_as_before_they_were_flattened():
    assert _tiers_script() == TIERS_GOLDEN
