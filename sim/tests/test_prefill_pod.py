"""The scheduling study's pieces in sim/: the tier model's pins and timed disk reads (what the
prefetch's survival and consumption rest on) and one prefill pod's replay."""

from __future__ import annotations

import numpy as np
import pytest

from agentserving.core.schemas import Tier
from agentserving.prefill.policies import FcfsNoChunk, LongcapDynamic
from agentserving.prefill.shadow import ShadowScheduler, StepTimeModel
from agentserving.sim.prefill_pod import Env, replay, service_estimate
from agentserving.sim.prefill_trace import make_trace
from agentserving.sim.tiers import DiskReads, PodTiers
from testkit.servers import import_bench

study = import_bench("prefill_sched_bench")   # the study's tuned Longcap settings

def _pod(dram: int = 4) -> PodTiers:
    return PodTiers("p", {Tier.CPU: dram, Tier.DISK: 1000}, 1)


def _in_dram(t: PodTiers, *hs: str) -> bool:
    return all(t.where.get(h) is Tier.CPU for h in hs)


def test_a_pinned_chunk_is_never_a_victim_and_counts_against_the_tier_size():
    t = _pod()
    t.store(["a", "b", "c", "d"])
    assert t.pin("a") and not t.pin("nowhere")
    t.store(["n0", "n1", "n2"])          # LRU pressure: 3 new chunks into 3 free places
    assert _in_dram(t, "a", "n0", "n1", "n2")
    assert t.where["b"] is Tier.DISK and t.where["d"] is Tier.DISK   # demoted, not lost
    assert len(t.lru[Tier.CPU]) + len(t.pinned) == 4
    t.use(["a"])                          # a hit keeps a pinned chunk's place
    t.unpin("a")                          # back in the LRU, most recently used
    t.store(["n3", "n4", "n5"])
    assert _in_dram(t, "a") and not _in_dram(t, "n0")
    t.store(["n6"])
    assert not _in_dram(t, "a")           # a plain LRU entry again


def test_promoting_a_pinned_chunk_out_of_its_tier_releases_the_pin():
    t = PodTiers("p", {Tier.DEVICE: 2, Tier.CPU: 2, Tier.DISK: 9}, 1)
    t.store(["a", "b", "c"])              # a is demoted to DRAM
    assert t.where["a"] is Tier.CPU and t.pin("a")
    t.use(["a"])                          # promoted to the device: no longer pinned in DRAM
    assert t.where["a"] is Tier.DEVICE and not t.pinned
    t.store(["d", "e", "f"])              # DRAM's full size is usable again
    assert t.count(Tier.CPU) == 2


def test_disk_reads_land_one_at_a_time_and_pins_survive_until_unpinned():
    t = _pod()
    t.place(["p1", "p2"], Tier.DISK)
    reads = DiskReads(t, disk_s=1.0, pin_share=0.5)
    reads.prefetch(("p1", "p2"), now=0.0, pin=True)
    reads.settle(0.5)
    assert reads.landing("p1") == 1.0 and not _in_dram(t, "p1")
    reads.settle(1.0)                     # one disk queue: 1 s a chunk
    assert _in_dram(t, "p1") and reads.landing("p2") == 2.0
    reads.settle(2.0)
    t.store([f"n{i}" for i in range(10)])  # new KV floods the LRU
    assert _in_dram(t, "p1", "p2") and set(t.pinned) == {"p1", "p2"}
    reads.unpin(("p1", "p2"))
    t.store([f"n{i}" for i in range(10, 14)])
    assert t.where["p1"] is Tier.DISK and t.where["p2"] is Tier.DISK


def test_pins_past_the_share_land_in_the_lru_and_a_later_request_supersedes_a_landing():
    t = _pod()
    t.place(["a", "b", "c", "x"], Tier.DISK)
    reads = DiskReads(t, disk_s=1.0, pin_share=0.5)
    reads.prefetch(("a", "b", "c"), now=0.0, pin=True)
    reads.settle(3.0)
    assert set(t.pinned) == {"a", "b"} and "c" in t.lru[Tier.CPU]   # 2 of 4 chunks
    t.store(["n0", "n1"])
    assert not _in_dram(t, "c") and _in_dram(t, "a")
    reads.prefetch(("x",), now=3.0)
    reads.prefetch(("x",), now=3.0)       # asked again: it lands at the later time only
    reads.settle(4.0)
    assert reads.landing("x") == 5.0 and not _in_dram(t, "x")
    reads.settle(5.0)
    assert _in_dram(t, "x") and reads.landing("x") is None


def _model() -> StepTimeModel:
    m = StepTimeModel(attention=True)
    m.coef = np.array([0.0, 1e-4, 0.0, 7e-8])   # the reference engine's calibration, rounded
    return m


def _run(env: Env, policy: object, n: int = 200) -> dict:
    model = _model()
    rate = 0.95 / service_estimate(make_trace(n, 1.0, 0), model, env, True)
    shadow = policy if isinstance(policy, ShadowScheduler) else None
    if shadow is not None:
        shadow.model.coef = model.coef.copy()
    return replay(policy, make_trace(n, rate, 0), model, {"cpu": 2e-4, "disk": 1e-3},
                  shadow=shadow, env=env, seed=0, keep_turns=True)


def _shadow() -> ShadowScheduler:
    longcap = LongcapDynamic(**study.LONGCAP, **study.cost_ratios(_model()))
    return ShadowScheduler(longcap, lookahead=5, model=StepTimeModel(attention=True))


def _env(dram: int, pin: bool) -> Env:
    return Env(noise=0.2, stall_prob=0.02, per_seq_s=0.002, dram_chunks=dram,
               store_new_kv=True, pin_prefetch=pin, wait_in_flight=pin)


def test_with_room_pinned_prefetches_are_all_read_from_dram():
    r = _run(_env(400, pin=True), _shadow())
    assert len(r["turn_latency_s"]) == 200 and min(r["turn_latency_s"].values()) > 0
    pf = r["prefetch"]
    assert pf["chunks"] > 0 and pf["used"] == pf["chunks"] and pf["survival"] == 1.0


def test_under_dram_pressure_pins_keep_more_prefetches_alive_than_plain_lru():
    pinned = _run(_env(60, pin=True), _shadow())["prefetch"]
    plain = _run(_env(60, pin=False), _shadow())["prefetch"]
    assert plain["survival"] < pinned["survival"] < 1.0
    assert plain["consumption_precision"] < pinned["consumption_precision"]


def test_a_replay_is_deterministic_for_its_seed_and_short_turns_skip_the_fcfs_queue():
    env = _env(400, pin=True)
    a, b = _run(env, _shadow()), _run(env, _shadow())
    assert a["turn_latency_s"] == b["turn_latency_s"]
    fcfs = _run(env, FcfsNoChunk(step_tokens=8192))
    assert a["latency_s"]["p50"] < fcfs["latency_s"]["p50"] / 2
    assert "prefetch" not in fcfs and fcfs["exposed_kv_s"]["p95"] > 0


@pytest.mark.parametrize("dram", [0, 4])
def test_land_reads_nothing_for_a_chunk_held_nowhere(dram):
    t = PodTiers("p", {Tier.CPU: dram, Tier.DISK: 9}, 1)
    assert not t.land("nowhere")
    t.place(["d"], Tier.DISK)
    assert t.land("d") is (dram > 0)
