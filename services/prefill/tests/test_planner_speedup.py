"""The fast planner decides exactly what the straightforward one decided.

``reference_planner`` keeps the first version (``dataclasses.replace`` per grant, the full
banker's loop per check). Every policy is run over random arrival streams on tight KV pods
(so the banker's loop, grant cutting and the timeline check all fire) with the fast planner,
and each step's decision is recomputed with the reference planner swapped in: they must be
equal, and so must the states ``advance`` and ``ref_advance`` produce.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from agentserving.prefill.policies import (
    FcfsChunk,
    FcfsNoChunk,
    LongcapDynamic,
    ReqView,
    SchedState,
    advance,
    fcfs,
    is_safe,
)
from agentserving.prefill.tests.reference_planner import RefPlanner, ref_advance, ref_is_safe

POLICIES = {
    "fcfs-nochunk": lambda: FcfsNoChunk(step_tokens=2048),
    "fcfs-chunk": lambda: FcfsChunk(chunk_tokens=512, chunk_align=128),
    "longcap-fcfs": lambda: LongcapDynamic(step_tokens=2048, short_tokens=1024, min_chunk=256,
                                           short_order="fcfs"),
    "longcap-shortest": lambda: LongcapDynamic(step_tokens=2048, short_tokens=1024,
                                               min_chunk=256, long_chunk_max=512,
                                               short_step=768, max_long_running=2,
                                               short_order="shortest"),
    "longcap-cost": lambda: LongcapDynamic(step_tokens=2048, short_tokens=1024, min_chunk=256,
                                           long_chunk_max=512, short_step=256,
                                           short_order="cost", context_cost=0.08,
                                           attention_cost=1e-4, shorts_per_step=1,
                                           step_cost=1500),
}


def _stream(rng: random.Random, n: int) -> list[ReqView]:
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(1.0)
        prompt = rng.choice([rng.randint(1, 600), rng.randint(600, 3000), rng.randint(3000, 9000)])
        cached = rng.randint(0, prompt - 1) // 128 * 128
        out.append(ReqView(f"r{i}", t, prompt, computed=cached, decode_left=rng.randint(0, 40)))
    return out


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("seed", range(4))
def test_fast_planner_matches_the_reference_decision_for_decision(name, seed, monkeypatch):
    rng = random.Random(seed)
    policy = POLICIES[name]()
    stream = _stream(rng, 40)
    s = SchedState((), (), max_running=rng.randint(2, 8),
                   kv_capacity_tokens=rng.randint(9000, 24000), block_size=16)
    checked = cut = 0
    for step in range(3000):
        while stream and stream[0].arrival <= step * 0.5:
            s = dataclasses.replace(s, waiting=s.waiting + (stream.pop(0),))
        fast = policy.decide(s)
        with monkeypatch.context() as m:
            m.setattr(fcfs, "Planner", RefPlanner)
            ref = policy.decide(s)
        assert fast == ref, f"step {step}"
        checked += 1
        cut += len(fast.admit) < len(s.waiting)
        nxt = advance(s, fast)
        assert nxt == ref_advance(s, fast)
        assert advance(s, fast, drop_finished=False) == ref_advance(s, fast, drop_finished=False)
        s = nxt
        if not stream and not s.waiting and not s.running:
            break
    assert not s.running and not s.waiting  # the run finished
    assert checked > 20 and cut > 0  # queues formed: admissions were actually refused


def test_is_safe_matches_the_reference_on_random_sets():
    rng = random.Random(7)
    disagreements = unsafe = 0
    for _ in range(3000):
        s = SchedState((), (), kv_capacity_tokens=rng.randint(500, 8000),
                       block_size=rng.choice([1, 16, 64]))
        views = []
        for i in range(rng.randint(0, 6)):
            prompt = rng.randint(1, 3000)
            views.append(ReqView(f"r{i}", 0, prompt, computed=rng.randint(0, prompt),
                                 decode_left=rng.randint(0, 500), running=rng.random() < 0.8))
        got, want = is_safe(s, tuple(views)), ref_is_safe(s, tuple(views))
        disagreements += got != want
        unsafe += not want
    assert disagreements == 0
    assert 100 < unsafe < 2900  # both outcomes were exercised
