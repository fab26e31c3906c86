"""New sessions are placed by how busy each decode pod's sessions keep it, not only by the
instant."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry

from agentserving.proxy.metrics import ProxyMetrics
from agentserving.proxy.orchestrator import Orchestrator
from agentserving.proxy.pod_activity import PodActivity
from agentserving.proxy.pods import PodPool
from agentserving.proxy.routing import (
    Candidate,
    LeastLoaded,
    RouteInput,
    affinity_order,
    make_policy,
)
from agentserving.proxy.settings import ProxySettings
from testkit.clock import ManualClock

from .test_decode_load import _pods_app, _turn


def test_a_pods_activity_is_its_recent_work_each_turn_fading_by_half_life():
    clock = ManualClock()
    activity = PodActivity(half_life_s=10.0, clock=clock)
    for _ in range(4):  # an agent in its loop, appends of 500 tokens
        activity.turn_placed("d0", 2048 + 500)
    activity.turn_placed("d1", 2048 + 6000)  # one chat's long first turn
    assert (activity.level("d0"), activity.level("d1")) == (10192.0, 8048.0)
    clock.now = 10.0
    assert (activity.level("d0"), activity.level("d1")) == pytest.approx((5096.0, 4024.0))
    activity.turn_placed("d1", 2048)
    assert activity.level("d1") == pytest.approx(6072.0)
    clock.now = 60.0  # five half-lives on: a finished chat has faded
    assert activity.level("d1") == pytest.approx(6072.0 / 32)
    assert activity.level("nowhere") == 0.0


def test_a_new_session_goes_where_recent_work_plus_load_is_least_and_a_placed_one_by_load():
    policy = LeastLoaded(turn_tokens=2048)
    busy_now = Candidate("d0", "u", inflight=1, queued_prompt_tokens=5000, recent_work=2500.0)
    crowded = Candidate("d1", "u", inflight=0, recent_work=12000.0)
    assert policy.rank(RouteInput("new", [busy_now, crowded]))[0].name == "d0"
    # a session that has a pod is ranked by load, as before: activity does not move it
    assert policy.rank(RouteInput("old", [busy_now, crowded], last_pod="d0"))[0].name == "d1"
    # a pod that fell behind places fewer turns, so its recent work looks lower; the turns
    # queued on it count too, and the new session goes to the pod that keeps up
    behind = Candidate("d0", "u", inflight=12, queued_prompt_tokens=9000, recent_work=50000.0)
    keeping_up = Candidate("d1", "u", inflight=2, recent_work=65000.0)
    assert policy.rank(RouteInput("new", [behind, keeping_up]))[0].name == "d1"


def test_sessions_arriving_one_by_one_spread_over_the_decode_pods():
    """Two sessions whose rendezvous order names the same decode pod first arrive one after
    the other, each finding every pod idle: by the instant's load both would land on that pod;
    the second goes where no session lives yet."""

    async def go() -> None:
        served: dict[str, str] = {}
        async with TestServer(_pods_app("p0", served, {})) as p0, \
                TestServer(_pods_app("d0", served, {})) as d0, \
                TestServer(_pods_app("d1", served, {})) as d1, \
                aiohttp.ClientSession() as http:
            urls = [str(s.make_url("")).rstrip("/") for s in (p0, d0, d1)]
            names = dict(zip(urls, ("p0", "d0", "d1"), strict=True))
            decoders = [Candidate(u, u) for u in urls[1:]]
            firsts = {}
            for k in range(200):
                firsts.setdefault(names[affinity_order(f"s{k}", decoders)[0].url], []).append(
                    f"s{k}")
            first, second = next(v for v in firsts.values() if len(v) >= 2)[:2]
            settings = ProxySettings(prefill_urls=urls[:1], decode_urls=urls[1:],
                                     local_prefill_tokens=0)
            pool = PodPool(settings.prefill_urls, settings.decode_urls, None)
            orch = Orchestrator(settings, pool, None, make_policy("kv-aware"), http,
                                ProxyMetrics(CollectorRegistry()))
            await orch.handle(_turn(first, 800))
            await orch.handle(_turn(second, 800))
            assert served[first] != served[second], served
            pods = [c.name for c in pool.decode_candidates()]
            # two P/D turns: each decode pod was given one turn's fixed share
            assert [orch.activity.level(n) for n in pods] == \
                pytest.approx([settings.load_penalty_tokens] * 2, rel=1e-3)
            # each keeps its pod for its next turn
            placed = served[second]
            await orch.handle(_turn(second, 900))
            assert served[second] == placed

    asyncio.run(go())
