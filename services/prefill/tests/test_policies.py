"""The pure policies on hand-built queues, and their invariants under random workloads."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentserving.prefill.policies import (
    Decision,
    FcfsChunk,
    FcfsNoChunk,
    LongcapDynamic,
    ReqView,
    SchedState,
    advance,
    is_safe,
    max_advance,
)
from agentserving.prefill.policies.base import reserved_blocks
from agentserving.prefill.shadow import ShadowScheduler, StepTimeModel


def w(rid: str, n: int, t: float, cached: int = 0, disk: tuple[str, ...] = ()) -> ReqView:
    return ReqView(rid, t, n, computed=cached, disk_chunks=disk)


def state(waiting=(), running=(), **kw) -> SchedState:
    return SchedState(tuple(waiting), tuple(running), **kw)


def test_fcfs_nochunk_runs_the_head_whole_and_blocks_the_rest():
    s = state([w("long", 20000, 0), w("short", 100, 1)])
    d = FcfsNoChunk(step_tokens=8192).decide(s)
    assert d.prefill == (("long", 20000),)
    assert d.admit == ("long",)


def test_fcfs_nochunk_batches_whole_prompts_that_fit_the_step():
    s = state([w("a", 3000, 0), w("b", 3000, 1), w("c", 3000, 2)])
    d = FcfsNoChunk(step_tokens=8192).decide(s)
    assert d.prefill == (("a", 3000), ("b", 3000))


def test_fcfs_chunk_fills_a_fixed_budget_oldest_first():
    run = ReqView("r", 0, 5000, computed=4800, running=True)
    s = state([w("a", 1000, 1), w("b", 1000, 2)], [run])
    d = FcfsChunk(chunk_tokens=512).decide(s)
    assert d.prefill == (("r", 200), ("a", 312))
    assert d.admit == ("a",)


def test_longcap_caps_the_long_band_and_lets_shorts_slip_in():
    long = ReqView("L", 0, 40000, computed=4096, running=True)
    s = state([w("s1", 300, 1), w("s2", 700, 2), w("L2", 30000, 3)], [long])
    p = LongcapDynamic(step_tokens=8192, long_cap=0.25, min_chunk=512)
    d = p.decide(s)
    grants = dict(d.prefill)
    # shorts are admitted whole; the long turn gets its capped share plus what they left
    assert grants["s1"] == 300 and grants["s2"] == 700
    assert grants["L"] == 8192 - 1000
    assert "L2" not in grants  # one long at a time (max_long_running=1)
    # no short pending: the long band takes the whole step
    alone = p.decide(state([], [long]))
    assert dict(alone.prefill)["L"] == 8192


def test_an_overdue_long_is_served_as_if_no_short_were_pending():
    """A decode pod's long first turn behind a stream of appends: capped while it is young;
    once it has waited ``long_max_wait_s`` it takes the step, and a second long that waited
    as long is admitted beside it past ``max_long_running``."""
    long = ReqView("L", 0.0, 40000, computed=4096, running=True)
    shorts = [w(f"s{i}", 1000, 1.0 + i) for i in range(8)]
    p = LongcapDynamic(step_tokens=8192, short_tokens=1024, long_cap=0.25, min_chunk=512,
                       long_max_wait_s=3.0)
    young = dict(p.decide(state([*shorts, w("L2", 30000, 0.5)], [long], now=2.9)).prefill)
    assert young["L"] == 2048 and "L2" not in young
    old = dict(p.decide(state([*shorts, w("L2", 30000, 0.5)], [long], now=3.5)).prefill)
    assert old["L"] == 8192 and not any(k.startswith("s") for k in old)
    # the first overdue long took the whole step; with room left the second joins it
    room = dict(p.decide(state([*shorts, w("L2", 30000, 0.5)],
                               [dataclasses.replace(long, computed=38000)], now=3.5)).prefill)
    assert room["L"] == 2000 and room["L2"] == 8192 - 2000
    # off (the default): the cap holds however long the long has waited
    capped = LongcapDynamic(step_tokens=8192, short_tokens=1024, long_cap=0.25, min_chunk=512)
    assert dict(capped.decide(state(shorts, [long], now=1e6)).prefill)["L"] == 2048
    with pytest.raises(ValueError, match="long_max_wait_s"):
        LongcapDynamic(long_max_wait_s=-1)


def test_longcap_long_share_when_shorts_fill_the_step():
    long = ReqView("L", 0, 40000, computed=0, running=True)
    shorts = [w(f"s{i}", 2000, 1 + i) for i in range(8)]
    d = LongcapDynamic(step_tokens=8192, long_cap=0.25, min_chunk=512).decide(
        state(shorts, [long]))
    grants = dict(d.prefill)
    assert grants["L"] == 2048  # exactly its cap, never starved
    assert sum(grants.values()) == 8192


def test_dynamic_chunk_follows_the_queue_and_the_free_kv():
    p = LongcapDynamic(step_tokens=8192, long_cap=0.5, min_chunk=256)
    roomy = state(kv_capacity_tokens=100_000, block_size=1)
    assert p.long_chunk(roomy, 0, False) == 8192        # no short pending: whole step
    assert p.long_chunk(roomy, 500, True) == 4096       # shorts pending: the cap share
    tight = state(kv_capacity_tokens=2000, block_size=1)
    assert p.long_chunk(tight, 500, True) == 1500       # what the free KV leaves the long
    assert p.long_chunk(state(kv_capacity_tokens=300, block_size=1), 500, True) == 256


@pytest.mark.parametrize("policy", [FcfsChunk(chunk_tokens=1000, chunk_align=128),
                                    LongcapDynamic(step_tokens=1000, min_chunk=128,
                                                   chunk_align=128)])
def test_alignment_rule_keeps_cached_plus_new_a_multiple_of_128(policy):
    s = state([w("a", 5000, 0, cached=100)])
    d = policy.decide(s)
    (rid, n), = d.prefill
    assert (100 + n) % 128 == 0 and n <= 1000
    # the final chunk may end anywhere
    run = ReqView("a", 0, 5000, computed=4480, running=True)
    assert dict(policy.decide(state([], [run])).prefill)["a"] == 520


def test_engine_rules_split_the_trailing_partial_chunk():
    r = ReqView("a", 0, 1100, computed=0, running=True)
    s = state(quantum=256, split_tail=True)
    assert max_advance(r, 5000, s, 0) == 1024
    assert max_advance(r, 600, s, 0) == 512
    assert max_advance(dataclasses.replace(r, computed=1024), 5000, s, 0) == 76


def test_admission_looks_at_the_whole_timeline_not_just_free_blocks_now():
    # 1000 tokens of KV; a running request will grow to 900. A 300-token request fits in
    # the free space *now* (600 left) but not alongside the other one's peak.
    run = ReqView("r", 0, 900, computed=300, running=True)
    s = state([w("new", 300, 1)], [run], kv_capacity_tokens=1000, block_size=1)
    for policy in (FcfsChunk(chunk_tokens=100), FcfsNoChunk(step_tokens=100),
                   LongcapDynamic(step_tokens=100, min_chunk=10)):
        d = policy.decide(s)
        assert "new" not in d.admit
        assert dict(d.prefill)["r"] > 0


def test_admission_credits_releases_the_timeline_predicts():
    # the running request finishes its last 100 tokens this step and releases 600: the
    # newcomer (peak 500) may start now, since its growth comes after that release.
    run = ReqView("r", 0, 600, computed=500, running=True)
    s = state([w("new", 500, 1)], [run], kv_capacity_tokens=1000, block_size=1)
    d = FcfsChunk(chunk_tokens=200).decide(s)
    assert d.admit == ("new",)


def test_shortest_first_serves_the_short_band_by_remaining_tokens():
    p = LongcapDynamic(step_tokens=8192, short_tokens=4096, min_chunk=256, short_step=1024,
                       short_order="shortest")
    s = state([w("a", 900, 0), w("b", 200, 1), w("c", 500, 2)])
    d = p.decide(s)
    assert d.admit == ("b", "c", "a") and dict(d.prefill) == {"b": 200, "c": 500, "a": 324}
    # fcfs order on the same queue: arrival order
    f = LongcapDynamic(step_tokens=8192, short_tokens=4096, min_chunk=256, short_step=1024)
    assert f.decide(s).admit == ("a", "b") and dict(f.decide(s).prefill) == {"a": 900, "b": 124}


def test_short_step_bounds_the_step_while_shorts_wait_and_longs_keep_min_chunk():
    long = ReqView("L", 0, 40000, computed=4096, running=True)
    p = LongcapDynamic(step_tokens=8192, short_tokens=4096, long_cap=0.25, min_chunk=256,
                       long_chunk_max=2048, short_step=512, short_order="shortest")
    grants = dict(p.decide(state([w(f"s{i}", 400, 1 + i) for i in range(4)], [long])).prefill)
    # cap share 0.25 * 512 = 128 < min_chunk: the long keeps 256, shorts get the rest
    assert grants == {"L": 256, "s0": 256} and sum(grants.values()) == 512
    # nothing short pending: the long band takes long_chunk_max, not the short step
    assert dict(p.decide(state([], [long])).prefill) == {"L": 2048}


def test_context_cost_keeps_deep_context_turns_from_being_cut_into_small_chunks():
    # re-reading 1 context token per chunk costs 0.05 of a new token: at 8192 tokens of
    # context a chunk must be >= 0.05 * 8192 / 0.25 = 1638 tokens to be worth cutting
    p = LongcapDynamic(step_tokens=8192, short_tokens=4096, min_chunk=256, short_step=512,
                       long_chunk_max=2048, short_order="shortest", context_cost=0.05)
    deep = w("deep", 8192 + 3000, 0, cached=8192)
    assert p.min_split(deep) == 1638
    d = p.decide(state([deep]))
    assert dict(d.prefill) == {"deep": 1638}  # the step grew past short_step for the head
    # a second deep turn behind a shallow head is not cut into the head's leftover
    shallow = w("s", 300, 1)
    d = p.decide(state([shallow, deep]))
    assert dict(d.prefill) == {"s": 300} and d.admit == ("s",)
    # without the cost: the leftover is used, in aligned-free pieces
    free = LongcapDynamic(step_tokens=8192, short_tokens=4096, min_chunk=256, short_step=512,
                          short_order="shortest")
    assert dict(free.decide(state([shallow, deep])).prefill) == {"s": 300, "deep": 212}
    # a running long at deep context gets a chunk of its min_split, not the 256 cap share
    long = ReqView("L", 0, 40000, computed=8192, running=True)
    grants = dict(p.decide(state([w("x", 300, 2)], [long])).prefill)
    assert grants["L"] == 1638


def test_a_blocked_admission_does_not_stall_running_shorts_behind_it():
    # no slot for the tiny newcomer: the larger running short still gets its chunk
    run = ReqView("r", 0, 3000, computed=1000, running=True)
    p = LongcapDynamic(step_tokens=4096, short_tokens=4096, min_chunk=256,
                       short_order="shortest")
    d = p.decide(state([w("tiny", 50, 1)], [run], max_running=1))
    assert d.admit == () and dict(d.prefill) == {"r": 2000}


# ------------------------------------------------------------------ properties

POLICIES = [
    lambda a: FcfsNoChunk(step_tokens=2048, chunk_align=a),
    lambda a: FcfsChunk(chunk_tokens=512, chunk_align=a),
    lambda a: LongcapDynamic(step_tokens=2048, short_tokens=1024, long_cap=0.25,
                             min_chunk=256, chunk_align=a),
    lambda a: LongcapDynamic(step_tokens=2048, short_tokens=1024, long_cap=0.5,
                             min_chunk=256, long_chunk_max=512, max_long_running=2,
                             chunk_align=a),
    lambda a: LongcapDynamic(step_tokens=2048, short_tokens=1024, long_cap=0.25,
                             min_chunk=256, long_chunk_max=1024, short_step=512,
                             short_order="shortest", chunk_align=a),
    lambda a: LongcapDynamic(step_tokens=2048, short_tokens=1024, long_cap=0.25,
                             min_chunk=256, long_chunk_max=1024, short_step=512,
                             short_order="shortest", context_cost=0.1, chunk_align=a),
    # the bench's tuned shape: cheapest-first, one short per step, a cost-sized step
    lambda a: LongcapDynamic(step_tokens=2048, short_tokens=1024, long_cap=0.25,
                             min_chunk=256, long_chunk_max=1024, short_step=256,
                             short_order="cost", context_cost=0.08, attention_cost=1e-4,
                             shorts_per_step=1, step_cost=1500, chunk_align=a),
    # the decode pods' shape: four longs at a time, half the step, a bound on a long's wait
    lambda a: LongcapDynamic(step_tokens=2048, short_tokens=1024, long_cap=0.5,
                             min_chunk=256, max_long_running=4, short_order="shortest",
                             long_max_wait_s=5.0, chunk_align=a),
]

jobs = st.lists(st.tuples(st.integers(1, 6000), st.integers(0, 3000), st.integers(0, 20),
                          st.integers(0, 8)), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs=jobs, which=st.integers(0, len(POLICIES) - 1), align=st.sampled_from([0, 128]),
       capacity=st.integers(9000, 30000), max_running=st.integers(1, 6))
def test_invariants_hold_and_everything_finishes(jobs, which, align, capacity, max_running):
    policy = POLICIES[which](align)
    pending = sorted(((t, i, n, min(c, n - 1), dec) for i, (n, c, t, dec) in enumerate(jobs)))
    s = SchedState((), (), max_running=max_running, kv_capacity_tokens=capacity, block_size=16)
    done: set[str] = set()
    for step in range(5000):
        s = dataclasses.replace(s, now=float(step))  # one step a second: waits grow
        while pending and pending[0][0] <= step:
            t, i, n, c, dec = pending.pop(0)
            s = dataclasses.replace(s, waiting=s.waiting + (ReqView(
                f"r{i}", t, n, computed=c // 128 * 128, decode_left=dec),))
        d = policy.decide(s)
        views = {r.req_id: r for r in s.running + s.waiting}
        for rid, n in d.prefill:
            r = views[rid]
            assert 0 < n <= r.remaining
            if n < r.remaining and align:
                assert (r.computed + n) % align == 0  # the alignment rule
        admitted = set(d.admit)
        assert admitted <= {r.req_id for r in s.waiting}
        assert {rid for rid, _ in d.prefill} <= admitted | {r.req_id for r in s.running}
        full = advance(s, d, drop_finished=False)
        assert len(full.running) <= max_running
        used = sum(reserved_blocks(full, r) for r in full.running)
        assert used <= full.capacity_blocks  # never over capacity: nothing evicted
        assert is_safe(full)
        before = {r.req_id for r in full.running}
        s = advance(s, d)
        done |= before - {r.req_id for r in s.running}
        if not pending and not s.waiting and not s.running:
            break
    assert len(done) == len(jobs)  # every request finished (no deadlock, no starvation)


# ------------------------------------------------------------------ shadow scheduler

def test_step_time_model_recovers_a_linear_cost():
    m = StepTimeModel(min_samples=4)
    for new, ctx in [(100, 100), (2000, 5000), (512, 9000), (4096, 4096), (64, 20000),
                     (1024, 1024)]:
        m.observe(new, ctx, 0.02 + 1e-4 * new + 2e-6 * ctx)
    assert m.predict(3000, 7000) == pytest.approx(0.02 + 0.3 + 0.014, rel=1e-6)


def test_shadow_prefetches_only_when_a_request_enters_the_n_plus_1_window():
    policy = FcfsChunk(chunk_tokens=1024)
    shadow = ShadowScheduler(policy, lookahead=5, prefetch_window=1)
    long = ReqView("L", 0, 4096, computed=0, running=True)
    queue = [w("a", 512, 1, disk=("h1", "h2")), w("b", 512, 2, disk=("h3",))]
    s = state(queue, [long])
    seen = []
    for _ in range(10):
        res = shadow.step(s)
        seen.append((dict(res.predictions), list(res.prefetch), res.decision.admit))
        s = advance(s, res.decision)
        if not s.waiting:
            break
    # step 0 runs 1024 of L; L takes N+1..N+3 whole, so a is admitted at N+4: not yet
    assert seen[0][0]["a"].offset == 4 and seen[0][1] == []
    # a is prefetched exactly at the step before its admission, and only once
    first = next(i for i, x in enumerate(seen) if x[1])
    assert first == 3  # N+4 seen from step 0 is N+1 seen from step 3
    assert seen[first][1] == [("a", ("h1", "h2")), ("b", ("h3",))]  # both fit step 4
    assert set(seen[first + 1][2]) == {"a", "b"}
    assert sum(1 for x in seen for rid, _ in x[1] if rid == "a") == 1


def test_shadow_does_not_change_the_policy_decision():
    policy = LongcapDynamic(step_tokens=2048, min_chunk=256)
    shadow = ShadowScheduler(LongcapDynamic(step_tokens=2048, min_chunk=256))
    s = state([w("a", 5000, 0), w("b", 300, 1), w("c", 9000, 2)])
    for _ in range(20):
        d = policy.decide(s)
        assert shadow.decide(s) == d
        s = advance(s, d)


def test_long_chunk_max_bounds_the_long_band_even_when_nothing_else_wants_the_step():
    p = LongcapDynamic(step_tokens=8192, long_cap=0.25, min_chunk=256, long_chunk_max=1024)
    long = ReqView("L", 0, 40000, computed=4096, running=True)
    # alone: the long gets long_chunk_max, not the whole step
    assert dict(p.decide(state([], [long])).prefill)["L"] == 1024
    # a small short pending: the top-up stops at long_chunk_max too
    grants = dict(p.decide(state([w("s", 300, 1)], [long])).prefill)
    assert grants == {"L": 1024, "s": 300}
    # shorts filling the step: the long keeps its (smaller) cap share, never starved
    shorts = [w(f"s{i}", 2000, 1 + i) for i in range(8)]
    grants = dict(LongcapDynamic(step_tokens=8192, long_cap=0.0625, min_chunk=256,
                                 long_chunk_max=1024).decide(state(shorts, [long])).prefill)
    assert grants["L"] == 512 and sum(grants.values()) == 8192
    # the default keeps the old behaviour: the whole step when no short is pending
    assert dict(LongcapDynamic(step_tokens=8192).decide(state([], [long])).prefill)["L"] == 8192


def test_long_chunk_max_must_fit_between_min_chunk_and_the_step():
    with pytest.raises(ValueError):
        LongcapDynamic(step_tokens=8192, min_chunk=512, long_chunk_max=256)
    with pytest.raises(ValueError):
        LongcapDynamic(step_tokens=4096, long_chunk_max=8192)


def test_attention_pairs_do_not_depend_on_how_a_prompt_is_chunked():
    whole = Decision(prefill=(("a", 6000),))
    s0 = state([w("a", 6000, 0)])
    total = StepTimeModel.attention_pairs(whole, s0)
    assert total == pytest.approx(6000 * 6001 / 2)
    chunked, s = 0.0, state([], [ReqView("a", 0, 6000, running=True)])
    for n in (512, 2048, 1000, 2440):
        d = Decision(prefill=(("a", n),))
        chunked += StepTimeModel.attention_pairs(d, s)
        s = advance(s, d)
    assert chunked == pytest.approx(total)
    # the 3-term context feature, by contrast, charges the chunked prompt and not the whole
    assert StepTimeModel.features(whole, s0) == (6000, 0)


def test_attention_step_time_model_recovers_its_cost_and_stays_non_negative():
    m = StepTimeModel(attention=True, min_samples=4)
    assert len(m.coef) == 4
    for new, ctx in [(256, 0), (1024, 0), (2048, 0), (256, 1024), (1024, 1024), (2048, 4096),
                     (512, 9000)]:
        m.observe(new, ctx, 0.01 + 1e-4 * new + 5e-8 * StepTimeModel.chunk_pairs(new, ctx))
    assert m.coef == pytest.approx([0.01, 1e-4, 0.0, 5e-8], rel=1e-4, abs=1e-9)
    assert m.predict(4096, 20000) == pytest.approx(
        0.01 + 0.4096 + 5e-8 * 4096 * (20000 + 4097 / 2), rel=1e-4)
    # data that would fit a negative context cost: that coefficient is clamped at exactly 0
    m2 = StepTimeModel(attention=True, min_samples=1)
    for new, ctx in [(256, 0), (256, 8000), (2048, 0), (2048, 8000), (1024, 4000)]:
        m2.observe(new, ctx, 0.02 + 1e-4 * new - 1e-6 * ctx)
    assert (m2.coef >= 0).all() and m2.coef[2] == 0.0
    with pytest.raises(ValueError):
        StepTimeModel(prior=(0.0, 1e-4, 0.0), attention=True)


def test_shadow_observe_step_fits_the_step_time_model_from_decisions():
    shadow = ShadowScheduler(FcfsChunk(chunk_tokens=1024), lookahead=2)
    assert shadow.model.attention
    shadow.model.min_samples = 3
    s = state([w(f"r{i}", 3000, i, cached=256 * i) for i in range(6)])
    truth = StepTimeModel(prior=(0.005, 2e-4, 1e-6, 3e-8), attention=True)
    for _ in range(12):
        d = shadow.decide(s)
        shadow.observe_step(d, s, truth.predict_step(d, s))
        s = advance(s, d)
    d = FcfsChunk(chunk_tokens=1024).decide(s)
    assert shadow.model.predict_step(d, s) == pytest.approx(truth.predict_step(d, s), rel=0.05)


def test_decision_is_empty_on_an_empty_pod():
    assert FcfsChunk().decide(state()) == Decision()


def test_arrival_aware_look_ahead_expects_newcomers_to_overtake():
    def run(arrivals: bool):
        pol = LongcapDynamic(step_tokens=512, short_tokens=4096, min_chunk=256, short_step=512,
                             short_order="shortest")
        sh = ShadowScheduler(pol, lookahead=3, arrivals=arrivals)
        # ten 300-token turns arrived 0.1 s apart: ~10 requests/s
        sh.step(state([w(f"x{i}", 300, i / 10) for i in range(10)], quantum=256))
        busy = ReqView("R", 0.5, 300, running=True)  # step N: R, and no aligned room for big
        return sh.step(state([w("big", 400, 1.0)], [busy], quantum=256)).predictions

    assert run(False)["big"].offset == 1   # nobody expected: admitted right after R
    with_arrivals = run(True)
    assert with_arrivals["big"].offset == 2  # a 300-token newcomer is expected to go first
    assert all(not rid.startswith("\x00") for rid in with_arrivals)  # phantoms never reported


# ------------------------------------------------------------------ cost-aware short band

COST = dict(step_tokens=8192, short_tokens=4096, min_chunk=256, short_step=256,
            long_chunk_max=2048, short_order="cost", context_cost=0.08, attention_cost=1e-4,
            split_overhead=0.25)


def test_cost_order_serves_the_cheapest_work_first_not_the_fewest_tokens():
    # 300 new tokens over 20k of context cost more than 900 over none: each chunk re-reads
    # the context (0.08 * 20480 per chunk) and attends to it (1e-4 * 300 * 20630)
    deep = w("deep", 20480 + 300, 0, cached=20480)
    fresh = w("fresh", 900, 1)
    p = LongcapDynamic(**COST, shorts_per_step=1)
    assert p.cost(deep, state()) == pytest.approx(300 + 0.08 * 20480 + 1e-4 * 300 * 20630.5)
    assert p.cost(fresh, state()) < p.cost(deep, state())
    assert p.decide(state([deep, fresh])).admit == ("fresh",)
    # the token count alone would have run the deep turn first
    tok = LongcapDynamic(**{**COST, "short_order": "shortest"}, shorts_per_step=1)
    assert tok.decide(state([deep, fresh])).admit == ("deep",)


def test_cost_counts_the_context_re_read_of_an_engine_split_tail():
    p = LongcapDynamic(**COST)
    r = w("r", 8192 + 300, 0, cached=8192)  # 256 full + a 44-token tail
    one = p.cost(r, state())
    two = p.cost(r, state(quantum=256, split_tail=True))
    assert two - one == pytest.approx(0.08 * 8192)
    aligned = w("a", 8192 + 512, 0, cached=8192)  # no partial tail: one chunk either way
    assert p.cost(aligned, state(quantum=256, split_tail=True)) == p.cost(aligned, state())


def test_shorts_per_step_runs_one_short_per_step_while_shorts_wait():
    queue = [w("a", 200, 0), w("b", 100, 1), w("c", 300, 2)]
    one = LongcapDynamic(**{**COST, "short_step": 1024}, shorts_per_step=1)
    d = one.decide(state(queue))
    assert d.admit == ("b",) and dict(d.prefill) == {"b": 100}
    many = LongcapDynamic(**{**COST, "short_step": 1024})
    assert many.decide(state(queue)).admit == ("b", "a", "c")
    # a running long keeps its band share beside the one short
    long = ReqView("L", 0, 40000, computed=0, running=True)
    grants = dict(one.decide(state(queue, [long])).prefill)
    assert set(grants) == {"L", "b"} and grants["L"] >= 256


def test_attention_cost_lowers_min_split_where_a_new_token_is_dearer():
    # a token at deep context costs 1 + ac * context new-token units: the re-read is a
    # smaller share of a chunk there, so a smaller chunk is already worth cutting
    r = w("r", 20480 + 4000, 0, cached=20480)
    plain = LongcapDynamic(**{**COST, "attention_cost": 0.0})
    att = LongcapDynamic(**COST)
    assert plain.min_split(r) == int(0.08 * 20480 / 0.25)
    assert att.min_split(r) == int(0.08 * 20480 / (0.25 * (1 + 1e-4 * 20480)))
    assert att.min_split(r) < plain.min_split(r)


def test_step_cost_sizes_the_head_chunk_by_its_predicted_cost():
    p = LongcapDynamic(**COST, shorts_per_step=1, step_cost=3000)
    shallow = w("s", 4000, 0)  # (short band: at most short_tokens=4096 left)
    n = p.tokens_within(shallow, 3000)
    chunk_cost = lambda r, k: k + 0.08 * r.computed + 1e-4 * k * (r.computed + (k + 1) / 2)  # noqa: E731
    assert chunk_cost(shallow, n) <= 3000 < chunk_cost(shallow, n + 1)
    assert dict(p.decide(state([shallow])).prefill) == {"s": n}
    # deep context: the re-read eats the cost budget, min_split still sets the floor
    deep = w("d", 40960 + 4000, 0, cached=40960)
    assert p.tokens_within(deep, 3000) == 0
    assert dict(p.decide(state([deep])).prefill) == {"d": p.min_split(deep)}


def test_cost_options_are_validated():
    with pytest.raises(ValueError, match="short_order"):
        LongcapDynamic(short_order="random")
    with pytest.raises(ValueError, match="attention_cost"):
        LongcapDynamic(attention_cost=-1.0)
    with pytest.raises(ValueError, match="shorts_per_step"):
        LongcapDynamic(shorts_per_step=-1)


# ------------------------------------------------------------------ shadow: robust, commit

def _sh_queue():
    """Step N runs R; "mid" (600 tokens) is next by cost. The recent arrivals were all
    100-token turns, ~10 a second: any of them would overtake "mid"."""
    pol = LongcapDynamic(**{**COST, "short_step": 512}, shorts_per_step=1)
    return pol, [w(f"x{i}", 100, i / 10) for i in range(10)]


def test_robust_window_leaves_out_a_turn_a_likely_newcomer_would_overtake():
    def window(robust: float, history):
        pol, _ = _sh_queue()
        sh = ShadowScheduler(pol, lookahead=3, robust=robust)
        sh.model.coef = [0.0, 1e-3, 0.0, 0.0]  # 1 ms a token: step N (R, 512) takes 0.5 s
        if history:
            s = state(history)
            while s.waiting or s.running:  # let the history arrive and drain
                s = advance(s, sh.step(s).decision)
        busy = ReqView("R", 1.0, 512, running=True)
        return sh.step(state([w("mid", 600, 1.0, disk=("h",))], [busy]))

    _, small = _sh_queue()
    plain = window(0.0, small)
    assert plain.window == {"mid"} and plain.prefetch == [("mid", ("h",))]
    # 10 arrivals/s for the 0.512 s of step N; of 8 samples of the recent arrivals (the 10
    # small turns and "mid" itself) 7 would overtake: p = exp(-10 * 0.512 * 7/8)
    robust = window(0.5, small)
    assert robust.predictions["mid"].offset == 1
    assert robust.predictions["mid"].p_admit == pytest.approx(math.exp(-10 * 0.512 * 7 / 8))
    assert robust.window == frozenset() and robust.prefetch == []
    # recent arrivals that would not overtake it (bigger turns): p = 1, in the window
    big = [w(f"y{i}", 3000, i / 10) for i in range(10)]
    assert window(0.5, big).window == {"mid"}


def test_commit_admits_the_n_plus_1_window_and_the_newcomer_waits_one_step():
    pol, _ = _sh_queue()
    busy = ReqView("R", 0.0, 512, running=True)
    s0 = state([w("mid", 600, 0.5, disk=("h",))], [busy])
    for commit, first in ((False, "new"), (True, "mid")):
        sh = ShadowScheduler(pol, lookahead=3, commit=commit)
        res = sh.step(s0)
        assert res.window == {"mid"}
        s1 = advance(s0, res.decision)
        s1 = dataclasses.replace(s1, waiting=s1.waiting + (w("new", 100, 0.7),))
        d1 = sh.step(s1).decision
        assert d1.admit == (first,)
        # the plain policy would have let the newcomer overtake; commit holds it one step
        assert pol.decide(s1).admit == ("new",)
        if commit:
            assert sh.step(advance(s1, d1)).decision.admit == ("new",)
