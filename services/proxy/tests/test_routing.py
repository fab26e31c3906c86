"""Routing policies, tool-gap prediction and API keys: pure decisions on hand-built inputs."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentserving.core.schemas import PodCallResult, PodPrefix
from agentserving.proxy.auth import ApiKeys, KeyEntry, tenant_salt
from agentserving.proxy.routing import (
    Candidate,
    KvAware,
    LeastLoaded,
    LlmdScheduler,
    RoundRobin,
    RouteInput,
    SessionAffinity,
    affinity_order,
    make_policy,
)
from agentserving.proxy.tool_gaps import (
    ToolGapPredictor,
    at_announce_header,
    parse_at_announce,
    prefetch_found,
)

PODS = [Candidate("p0", "http://a"), Candidate("p1", "http://b"), Candidate("p2", "http://c")]


def prefix(pod, score, n=None):
    return PodPrefix(pod=pod, prefix_chunks=n or int(score), tiers={}, score=score)


def test_kv_aware_goes_to_the_longest_weighted_prefix():
    policy = KvAware(chunk_size=256, load_penalty_tokens=2048)
    inp = RouteInput("s", PODS, {"p1": prefix("p1", 40), "p2": prefix("p2", 10)})
    assert [c.name for c in policy.rank(inp)][:2] == ["p1", "p2"]


def test_kv_aware_gives_up_a_small_prefix_to_avoid_a_busy_pod():
    policy = KvAware(chunk_size=256, load_penalty_tokens=2048)
    busy = [Candidate("p0", "u", 0), Candidate("p1", "u", 3), Candidate("p2", "u", 0)]
    # p1 holds 4 chunks = 1024 tokens but has 3 turns in flight (6144 tokens of penalty)
    inp = RouteInput("s", busy, {"p1": prefix("p1", 4)})
    assert policy.rank(inp)[0].name != "p1"
    # a long prefix (40 chunks = 10240 tokens) is still worth the queue
    inp = RouteInput("s", busy, {"p1": prefix("p1", 40)})
    assert policy.rank(inp)[0].name == "p1"


def test_kv_aware_degrades_to_session_affinity_without_the_index():
    policy = KvAware()
    down = RouteInput("sess-9", PODS, {"p2": prefix("p2", 99)}, index_available=False)
    assert policy.rank(down) == SessionAffinity().rank(RouteInput("sess-9", PODS))
    assert policy.rank(RouteInput("sess-9", PODS, last_pod="p2"))[0].name == "p2"


def test_least_loaded_decode_sticks_to_the_sessions_pod_only_on_a_tie():
    policy = LeastLoaded()
    idle = [Candidate("d0", "u", 0), Candidate("d1", "u", 0)]
    for last in ("d0", "d1"):
        assert policy.rank(RouteInput("s", idle, last_pod=last))[0].name == last
    busy = [Candidate("d0", "u", 2), Candidate("d1", "u", 1)]
    assert policy.rank(RouteInput("s", busy, last_pod="d0"))[0].name == "d1"
    # first turns (no previous pod) spread over the pool by session, not all to d0
    firsts = {policy.rank(RouteInput(f"sess-{i}", idle))[0].name for i in range(20)}
    assert firsts == {"d0", "d1"}


def test_llmd_keeps_a_session_on_its_pod_until_that_pod_saturates():
    llmd = LlmdScheduler()
    cached = {"p0": prefix("p0", 8.0)}  # the whole prompt cached on p0
    busy = [Candidate("p0", "a"), Candidate("p1", "b", queued_prompts=5), Candidate("p2", "c")]
    # sticky: its pod p1 has 5 turns waiting (the threshold), more prefix elsewhere
    inp = RouteInput("s", busy, cached, last_pod="p1", prompt_chunks=8)
    assert llmd.rank(inp)[0].name == "p1"
    # one more waiting turn saturates p1: the session moves to the best scored pod, p1 last
    saturated = [busy[0], Candidate("p1", "b", queued_prompts=6), busy[2]]
    order = llmd.rank(RouteInput("s", saturated, cached, last_pod="p1", prompt_chunks=8))
    assert [c.name for c in order][0::2] == ["p0", "p1"]
    # every pod saturated: the filter lets all through, and the session stays
    full = [Candidate(c.name, c.url, queued_prompts=9) for c in PODS]
    assert llmd.rank(RouteInput("s", full, cached, last_pod="p1", prompt_chunks=8)
                     )[0].name == "p1"


def test_llmd_weighs_the_prefix_share_twice_the_queue():
    llmd = LlmdScheduler()
    pods = [Candidate("p0", "a", queued_prompts=4), Candidate("p1", "b"), Candidate("p2", "c")]
    # p0: 3/4 of the prompt cached in DRAM (score 0.8 per chunk) but the longest queue;
    # prefix 2 x 0.6 + queue 0 = 1.2 against p1's 0 + 1
    inp = RouteInput(None, pods, {"p0": prefix("p0", 4.8, n=6)}, prompt_chunks=8)
    assert llmd.rank(inp)[0].name == "p0"
    # a quarter cached: 2 x 0.2 = 0.4 < 1: the idle pods first
    inp = RouteInput(None, pods, {"p0": prefix("p0", 1.6, n=2)}, prompt_chunks=8)
    assert llmd.rank(inp)[-1].name == "p0"
    # no lookup (a one-chunk prompt, the index down): the least queued pods first
    assert llmd.rank(RouteInput(None, pods))[-1].name == "p0"


def test_round_robin_rotates():
    rr = RoundRobin()
    firsts = [rr.rank(RouteInput(None, PODS))[0].name for _ in range(6)]
    assert firsts == ["p0", "p1", "p2", "p0", "p1", "p2"]


@given(st.text(min_size=1, max_size=20))
def test_affinity_is_stable_and_minimal_on_pod_loss(sid):
    first = affinity_order(sid, PODS)[0]
    assert affinity_order(sid, list(reversed(PODS)))[0] == first
    remaining = [c for c in PODS if c.name != "p1"]
    if first.name != "p1":  # only the sessions of the pod that left move
        assert affinity_order(sid, remaining)[0] == first


def test_make_policy_names():
    assert make_policy("kv-aware").name == "kv-aware"
    assert make_policy("session").name == "session"
    assert make_policy("llm-d").name == "llm-d" and make_policy("llm-d").uses_index
    with pytest.raises(ValueError, match="unknown routing policy 'random'"):
        make_policy("random")


def test_tool_gap_predictor_learns_per_tool():
    pred = ToolGapPredictor(alpha=0.5, default_gap_s=2.0)
    assert pred.predict("bash") == 2.0
    pred.observe("bash", 10.0)
    pred.observe("bash", 20.0)
    assert pred.predict("bash") == pytest.approx(15.0)
    pred.observe("search", 1.0)
    assert pred.predict("search") == pytest.approx(1.0)
    assert pred.predict("unknown-tool") == pytest.approx(pred._overall.value)
    assert pred.prefetch_delay("bash", lead_s=3.0) == pytest.approx(12.0)
    assert pred.prefetch_delay("search", lead_s=3.0) == 0.0


def test_tool_gap_predictor_keeps_a_bounded_table_of_tools():
    pred = ToolGapPredictor(alpha=0.5, default_gap_s=2.0, max_tools=2)
    for i, gap in enumerate((4.0, 6.0, 30.0)):
        pred.observe(f"tool-{i}", gap)
    assert pred.predict("tool-0") == 4.0 and pred.predict("tool-1") == 6.0
    # a third name is learnt by the overall mean only, and predicted by it
    assert pred.predict("tool-2") == pytest.approx(pred._overall.value)
    assert len(pred._per_tool) == 2
    pred.observe("tool-0", 8.0)  # a known tool still learns
    assert pred.predict("tool-0") == pytest.approx(6.0)


def test_prefetch_found_sums_the_pods_replies_by_tier():
    results = {
        "decode-0": PodCallResult(ok=True, num_chunks=5, response={
            "status": "prefetch_started", "num_chunks": 5, "num_in_cpu": 1, "num_to_load": 3,
            "num_missing": 1}),
        "prefill-0": PodCallResult(ok=True, num_chunks=4, response={
            "status": "prefetch_scheduled", "num_chunks": 4}),
        "decode-1": PodCallResult(ok=False, num_chunks=2, error="pod gone"),
    }
    assert prefetch_found(results) == {"dram": 1, "disk": 3, "missing": 1, "scheduled": 4,
                                       "held": 0}
    assert prefetch_found({}) == {"dram": 0, "disk": 0, "missing": 0, "scheduled": 0,
                                  "held": 0}
    # a pod whose scheduler took the announce says where its chunks are now
    results["prefill-0"] = PodCallResult(ok=True, num_chunks=4, response={
        "status": "prefetch_scheduled", "num_chunks": 4, "num_in_cpu": 1, "num_to_load": 2,
        "num_missing": 1, "num_held": 3})
    found = prefetch_found(results)
    assert found == {"dram": 2, "disk": 5, "missing": 2, "scheduled": 0, "held": 3}
    assert at_announce_header(found) == "dram=2,disk=5,missing=2,held=3"
    assert parse_at_announce(at_announce_header(found)) == {"dram": 2, "disk": 5, "missing": 2,
                                                            "held": 3}
    assert parse_at_announce("none") == {}
    assert at_announce_header(prefetch_found({})) == "none"


def test_api_keys(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [{"key": "sk-acme-123456", "tenant": "acme"},
                                         {"key": "sk-beta-123456", "tenant": "beta",
                                          "cache_salt": "s3cret"}]}))
    keys = ApiKeys.load(path)
    assert keys.authenticate("Bearer sk-acme-123456").tenant == "acme"
    assert keys.authenticate("bearer sk-beta-123456").cache_salt == "s3cret"
    assert keys.authenticate("Bearer nope-nope-nope") is None
    assert keys.authenticate(None) is None
    with pytest.raises(ValueError):
        KeyEntry(key="short", tenant="x")


def test_default_tenant_salts_need_a_secret_no_tenant_holds():
    """A salt a tenant can compute lets it rebuild another's chunk hashes and probe them."""
    acme = KeyEntry(key="sk-acme-123456", tenant="acme")
    beta = KeyEntry(key="sk-beta-123456", tenant="beta")

    def salt(entries, tenant_key, secret=None):  # type: ignore[no-untyped-def]
        return ApiKeys(entries, secret).authenticate(f"Bearer {tenant_key}").cache_salt

    no_secret = salt([acme, beta], acme.key)
    assert no_secret not in ("tenant:acme", "acme") and "acme" not in no_secret.split(":", 1)[1]
    assert no_secret != salt([acme, beta], beta.key)  # tenants apart
    # without --salt-secret it rests on every key: acme alone (knowing only its own) gets
    # another salt than the deployment's
    assert salt([acme], acme.key) != no_secret
    # with one, it is the secret's alone: stable across key rotation, new with a new secret
    rotated = KeyEntry(key="sk-acme-rotated", tenant="acme")
    assert salt([acme, beta], acme.key, "s1") == salt([rotated, beta], rotated.key, "s1")
    assert salt([acme, beta], acme.key, "s1") != salt([acme, beta], acme.key, "s2")
    assert salt([acme, beta], acme.key, "s1") == tenant_salt(b"s1", "acme")
