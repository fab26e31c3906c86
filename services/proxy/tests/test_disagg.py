"""Conditional disaggregation: which turns skip the prefill pod, and the proxy's attempt order."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from agentserving.core.schemas import LookupResponse, PodPrefix
from agentserving.proxy.disagg import (
    UNASKED,
    HeldContext,
    LocalPlan,
    Placement,
    PromptSize,
    local_prefill_tokens,
    plan_local_pod,
    prefill_on_decode_pod,
    prompt_size,
)
from agentserving.proxy.metrics import ProxyMetrics
from agentserving.proxy.orchestrator import Orchestrator, Turn, untried
from agentserving.proxy.pods import PodPool
from agentserving.proxy.routing import Candidate, make_policy
from agentserving.proxy.sessions import SessionState
from agentserving.proxy.settings import ProxySettings
from agentserving.proxy.upstream import TurnOutcome


def test_prompt_size_of_each_request_shape():
    assert prompt_size("/v1/completions", {"prompt": [1, 2, 3]}) == PromptSize(3, None)
    assert prompt_size("/v1/completions", {"prompt": "hello"}) == PromptSize(None, 5)
    assert prompt_size("/v1/completions", {"prompt": [[1], [2]]}) == PromptSize(None, None)
    chat = {"messages": [{"role": "system", "content": "abc"},
                         {"role": "user", "content": [{"type": "text", "text": "de"},
                                                      {"type": "image_url"}]}]}
    assert prompt_size("/v1/chat/completions", chat) == PromptSize(None, 5)
    assert prompt_size("/v1/chat/completions", {}) == PromptSize(None, None)


def test_token_prompts_count_what_the_decode_pod_lacks():
    held = HeldContext(prompt_tokens=1000, prompt_chars=None, chunk_size=256)
    assert held.held_tokens == 768  # the partial chunk is not kept
    assert local_prefill_tokens(PromptSize(1300, None), held) == 1300 - 768
    assert prefill_on_decode_pod(PromptSize(1200, None), held, threshold=512)
    assert not prefill_on_decode_pod(PromptSize(1400, None), held, threshold=512)
    assert not prefill_on_decode_pod(PromptSize(1200, None), held, threshold=0)  # disabled


def test_text_prompts_are_sized_by_the_sessions_own_tokens_per_char():
    held = HeldContext(prompt_tokens=1024, prompt_chars=4096, chunk_size=256)  # 4 chars/token
    assert local_prefill_tokens(PromptSize(None, 4096 + 800), held) == 200
    no_ratio = HeldContext(prompt_tokens=1024, prompt_chars=None, chunk_size=256)
    assert local_prefill_tokens(PromptSize(None, 5000), no_ratio) is None
    assert not prefill_on_decode_pod(PromptSize(None, 5000), no_ratio, threshold=10_000)


def test_unsizable_or_shrunk_prompts_go_through_the_prefill_pod():
    held = HeldContext(prompt_tokens=2000, prompt_chars=None, chunk_size=256)
    assert not prefill_on_decode_pod(PromptSize(None, None), held, threshold=10_000)
    assert not prefill_on_decode_pod(PromptSize(1500, None), held, threshold=10_000)  # compacted
    assert not prefill_on_decode_pod(PromptSize(2100, None), None, threshold=10_000)  # no history


@given(prev=st.integers(1, 50_000), grow=st.integers(0, 5000), chunk=st.sampled_from([16, 256]),
       threshold=st.integers(0, 4096))
def test_the_decision_is_the_threshold_on_uncomputed_tokens(prev, grow, chunk, threshold):
    held = HeldContext(prev, None, chunk)
    n = local_prefill_tokens(PromptSize(prev + grow, None), held)
    assert n is not None and grow <= n < grow + chunk
    assert prefill_on_decode_pod(PromptSize(prev + grow, None), held, threshold) == \
        (threshold > 0 and n <= threshold)


def attempts_for(state: SessionState, prompt_len: int, threshold: int = 512,
                 max_backlog: int = 0, prefill_inflight: int = 0,
                 kvindex: object = None, prefill_urls: tuple[str, ...] = ("http://p0",),
                 hosts: bool = False, decode_inflight: tuple[int, int] = (0, 0),
                 decode_queued: tuple[int, int] = (0, 0), balance: int = 0
                 ) -> list[tuple[str, str | None]]:
    async def go() -> list[tuple[str, str | None]]:
        settings = ProxySettings(prefill_urls=list(prefill_urls),
                                 decode_urls=["http://d0", "http://d1"],
                                 local_prefill_tokens=threshold,
                                 max_prefill_backlog=max_backlog,
                                 prefill_hosts_sessions=hosts, balance_tokens=balance)
        async with aiohttp.ClientSession() as http:
            pool = PodPool(settings.prefill_urls, settings.decode_urls, None)
            for _ in range(prefill_inflight):
                pool.acquire("http://p0")
            for pod, n, queued in zip(settings.decode_urls, decode_inflight, decode_queued,
                                      strict=True):
                for _ in range(n):
                    pool.acquire(pod)
                pool.queue_prompt(pod, queued)
            orch = Orchestrator(settings, pool, kvindex, make_policy("kv-aware"), http,  # type: ignore[arg-type]
                                ProxyMetrics(CollectorRegistry()))
            turn = Turn(endpoint="/v1/completions", body={"prompt": [1] * prompt_len},
                        session_id="s", session_key="s")
            routed = await orch._route(turn, state)
            local = await orch._local_pod(turn, state, routed)
            pairs = orch._attempts(routed.prefill, routed.decode, local)
        return [(p.name, d.name if d else None) for p, d in pairs]

    return asyncio.run(go())


@pytest.mark.parametrize("pod", ["http://d0", "http://d1"])
def test_a_short_append_runs_first_on_the_sessions_decode_pod(pod):
    state = SessionState(last_decode_pod=pod, prompt_tokens=3000)
    pairs = attempts_for(state, 3000 + 200)
    assert pairs[0] == (pod, None)  # whole turn on the pod holding the context
    assert pairs[1][0] == "http://p0" and pairs[1][1] is not None  # P/D is the fallback
    other = {"http://d0": "http://d1", "http://d1": "http://d0"}[pod]
    assert pairs[-1] == (other, None)  # the last resort: another decode pod, the turn whole
    assert (pod, None) not in pairs[1:]  # the pod tried first is not a last resort again
    assert len(pairs) <= ProxySettings().max_attempts + 1


def test_long_appends_first_turns_and_disabled_threshold_disaggregate():
    long_append = attempts_for(SessionState(last_decode_pod="http://d0", prompt_tokens=3000),
                               3000 + 2000)
    first_turn = attempts_for(SessionState(), 3000)
    disabled = attempts_for(SessionState(last_decode_pod="http://d0", prompt_tokens=3000),
                            3100, threshold=0)
    gone = attempts_for(SessionState(last_decode_pod="http://d9", prompt_tokens=3000), 3100)
    for pairs in (long_append, first_turn, disabled, gone):
        assert pairs[0][0] == "http://p0" and pairs[0][1] is not None
        # after every P/D pair, the last resorts: every decode pod computes the whole turn
        assert pairs[-2:] == [("http://d0", None), ("http://d1", None)]
        assert len(pairs) <= ProxySettings().max_attempts + 2


def test_a_pod_that_failed_this_turn_is_not_asked_again():
    p0, d0, d1 = (Candidate(name=n, url=n) for n in ("p0", "d0", "d1"))
    attempts = [(d0, None), (p0, d0), (p0, d1), (d0, None), (d1, None)]
    failed: set[str] = set()
    tried = []
    for pair in untried(attempts, failed):
        tried.append(pair)
        failed.add({0: "d0", 1: "p0"}.get(len(tried) - 1, "none"))  # d0 fails, then p0
    assert tried == [(d0, None), (p0, d1), (d1, None)]


def test_a_saturated_prefill_pool_sends_turns_to_a_decode_pod():
    busy = dict(max_backlog=2, prefill_inflight=2)
    first = attempts_for(SessionState(), 3000, **busy)
    assert first[0][1] is None and first[0][0].startswith("http://d")  # least-loaded decode pod
    own = attempts_for(SessionState(last_decode_pod="http://d1", prompt_tokens=3000), 9000,
                       **busy)
    assert own[0] == ("http://d1", None)  # a long append too, on the session's own pod
    calm = attempts_for(SessionState(), 3000, max_backlog=2, prefill_inflight=1)
    assert calm[0][0] == "http://p0"


@given(backlog=st.integers(0, 5), limit=st.integers(0, 5))
def test_the_backlog_rule_alone(backlog, limit):
    local = prefill_on_decode_pod(PromptSize(None, None), None, 512, backlog, limit)
    assert local == (limit > 0 and backlog >= limit)


def test_a_long_append_stays_local_when_the_prefill_pod_lacks_the_context():
    held = HeldContext(prompt_tokens=5000, prompt_chars=None, chunk_size=256)  # 4864 held
    size = PromptSize(5000 + 3000, None)  # 3136 to compute locally: over the threshold
    assert not prefill_on_decode_pod(size, held, 2048)
    # the prefill pod holds only the first turn's 2048 tokens: it would compute 5952
    assert prefill_on_decode_pod(size, held, 2048, remote_tokens=8000 - 2048)
    # it holds nearly all of it: P/D
    assert not prefill_on_decode_pod(size, held, 2048, remote_tokens=8000 - 4608)


class PrefixIndex:
    """A stand-in kvindex: every pod asked about holds ``chunks`` leading chunks."""

    def __init__(self, chunks: int) -> None:
        self.chunks, self.lookups = chunks, 0

    async def lookup(self, req):  # type: ignore[no-untyped-def]
        self.lookups += 1
        return LookupResponse(num_chunks=len(req.chunk_hashes), best_pod=req.pods[0], pods=[
            PodPrefix(pod=p, prefix_chunks=self.chunks, tiers={}, score=self.chunks)
            for p in req.pods])


@pytest.mark.parametrize("prefill_chunks, local", [(8, True), (19, False)])
def test_the_orchestrator_asks_the_kvindex_before_a_long_append(prefill_chunks, local):
    state = SessionState(last_decode_pod="http://d0", prompt_tokens=5000,
                         chunk_hashes=[f"{i:064x}" for i in range(19)])
    index = PrefixIndex(prefill_chunks)
    pairs = attempts_for(state, 8000, threshold=2048, kvindex=index)
    assert index.lookups == 1
    assert (pairs[0] == ("http://d0", None)) == local
    short = PrefixIndex(prefill_chunks)
    assert attempts_for(state, 5200, threshold=2048, kvindex=short)[0] == ("http://d0", None)
    assert short.lookups == 0  # a short append needs no lookup


@pytest.mark.parametrize("prefill_chunks, local", [(8, True), (19, False)])
def test_routings_kvindex_answer_serves_the_long_append_question(prefill_chunks, local):
    """With two prefill pods routing asks the kvindex about the session's chunks; conditional
    disaggregation's question is about the same chunks, so it is answered from that reply."""
    state = SessionState(last_decode_pod="http://d0", prompt_tokens=5000,
                         chunk_hashes=[f"{i:064x}" for i in range(19)])
    index = PrefixIndex(prefill_chunks)
    pairs = attempts_for(state, 8000, threshold=2048, kvindex=index,
                         prefill_urls=("http://p0", "http://p1"))
    assert index.lookups == 1
    assert (pairs[0] == ("http://d0", None)) == local


def test_a_turn_run_whole_on_a_decode_pod_makes_it_the_sessions_own():
    """A first turn that ran whole on a decode pod (the prefill pool was saturated) left the
    session's context there: its next short append runs there too, not P/D through a prefill
    pod that never saw it. A prefill pod serving a turn alone owns no session."""
    async def go() -> tuple[SessionState, SessionState]:
        settings = ProxySettings(prefill_urls=["http://p0"],
                                 decode_urls=["http://d0", "http://d1"])
        async with aiohttp.ClientSession() as http:
            orch = Orchestrator(settings, PodPool(settings.prefill_urls, settings.decode_urls,
                                                  None),
                                None, make_policy("kv-aware"), http,
                                ProxyMetrics(CollectorRegistry()))
            turn = Turn(endpoint="/v1/completions", body={"prompt": [1] * 3000},
                        session_id="s", session_key="s")
            on_decode, on_prefill = SessionState(), SessionState()
            orch._finish(turn, on_decode, Candidate("http://d1", "http://d1"),
                         TurnOutcome(prompt_tokens=3000))
            orch._finish(turn, on_prefill, Candidate("http://p0", "http://p0"),
                         TurnOutcome(prompt_tokens=3000))
        return on_decode, on_prefill

    on_decode, on_prefill = asyncio.run(go())
    assert on_decode.last_decode_pod == "http://d1" and on_prefill.last_decode_pod is None
    assert attempts_for(on_decode, 3000 + 200)[0] == ("http://d1", None)


def test_an_idle_prefill_pod_hosting_sessions_takes_a_first_turn_when_decode_pods_are_busy():
    """--prefill-hosts-sessions: a first turn that would go P/D while both decode pods are busy
    runs whole on the idle prefill pod, which becomes the session's own: its next short append
    runs there as on a decode pod. Without the flag, or with a decode pod idle, or with the
    prefill pod busy, nothing changes."""
    busy = (1, 2)
    assert attempts_for(SessionState(), 3000, hosts=True, decode_inflight=busy)[0] == \
        ("http://p0", None)
    for kwargs in (dict(hosts=False, decode_inflight=busy),
                   dict(hosts=True, decode_inflight=(0, 2))):
        first = attempts_for(SessionState(), 3000, **kwargs)[0]  # type: ignore[arg-type]
        assert first[0] == "http://p0" and first[1] is not None  # P/D
    busy_prefill = attempts_for(SessionState(), 3000, hosts=True, decode_inflight=busy,
                                max_backlog=1, prefill_inflight=1)[0]
    assert busy_prefill == ("http://d0", None)  # the least-loaded decode pod, whole

    async def finish(hosts: bool) -> SessionState:
        settings = ProxySettings(prefill_urls=["http://p0"], decode_urls=["http://d0"],
                                 prefill_hosts_sessions=hosts)
        async with aiohttp.ClientSession() as http:
            orch = Orchestrator(settings, PodPool(settings.prefill_urls, settings.decode_urls,
                                                  None), None, make_policy("kv-aware"), http,
                                ProxyMetrics(CollectorRegistry()))
            state = SessionState()
            orch._finish(Turn(endpoint="/v1/completions", body={"prompt": [1] * 3000},
                              session_id="s", session_key="s"), state,
                         Candidate("http://p0", "http://p0"), TurnOutcome(prompt_tokens=3000))
            return state

    hosted = asyncio.run(finish(True))
    assert hosted.last_decode_pod == "http://p0"
    assert asyncio.run(finish(False)).last_decode_pod is None
    append = attempts_for(hosted, 3000 + 200, hosts=True)
    assert append[0] == ("http://p0", None)  # its own pod, though both decode pods are idle
    assert append[1][0] == "http://p0" and append[1][1] is not None  # P/D is the fallback
    long_append = attempts_for(hosted, 3000 + 3000, hosts=True)[0]
    assert long_append[0] == "http://p0" and long_append[1] is not None  # P/D: moves


def test_a_pd_turns_decode_pod_counts_as_taken_during_its_prefill_stage():
    """Two first turns: ``a`` goes P/D; ``b`` arrives during a's prefill stage, finds the
    prefill pod busy and runs whole on a decode pod. It must take the other one: a's decode pod
    is a's from the moment it was chosen, though it has not been sent anything yet. ``b``'s
    session id is picked so that, on a tie, its rendezvous order names a's decode pod first."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from agentserving.proxy.routing import affinity_order

    served: dict[str, str] = {}

    def app(name: str, delay_s: float) -> web.Application:
        async def completions(request: web.Request) -> web.Response:
            body = await request.json()
            await asyncio.sleep(delay_s)
            if body.get("kv_transfer_params", {}).get("do_remote_decode"):
                return web.json_response({"choices": [{"text": "", "finish_reason": "length"}],
                                          "kv_transfer_params": {"ready": True}})
            served[body["user"]] = name
            return web.json_response({"choices": [{"text": "ok", "finish_reason": "stop"}]})

        application = web.Application()
        application.router.add_post("/v1/completions", completions)
        return application

    async def go() -> None:
        async with TestServer(app("p0", 0.4)) as p0, TestServer(app("d0", 0.0)) as d0, \
                TestServer(app("d1", 0.0)) as d1, aiohttp.ClientSession() as http:
            urls = [str(s.make_url("")).rstrip("/") for s in (p0, d0, d1)]
            settings = ProxySettings(prefill_urls=urls[:1], decode_urls=urls[1:],
                                     max_prefill_backlog=1)
            pool = PodPool(settings.prefill_urls, settings.decode_urls, None)
            orch = Orchestrator(settings, pool, None, make_policy("kv-aware"), http,
                                ProxyMetrics(CollectorRegistry()))

            def turn(sid: str) -> Turn:
                return Turn(endpoint="/v1/completions", session_id=sid, session_key=sid,
                            body={"prompt": [1] * 3000, "user": sid})

            decoders = [Candidate(u, u) for u in urls[1:]]
            taken = affinity_order("a", decoders)[0].url  # a's pick among idle decode pods
            b = next(f"b{k}" for k in range(100)
                     if affinity_order(f"b{k}", decoders)[0].url == taken)
            a = asyncio.create_task(orch.handle(turn("a")))
            await asyncio.sleep(0.15)  # a is in its prefill stage
            await orch.handle(turn(b))
            await a
            assert served["a"] != served[b], served
            assert sorted(served.values()) == ["d0", "d1"]

    asyncio.run(go())


def _placement(prompt: int | None, *, own: bool = True, held: int | None = 3000,
               prefill_inflight: int = 0, decode_inflight: int = 0,
               host_inflight: int | None = None, max_backlog: int = 0) -> Placement:
    d0, d1 = Candidate("d0", "d0", decode_inflight), Candidate("d1", "d1", decode_inflight)
    hosts = [Candidate("p0", "p0", host_inflight)] if host_inflight is not None else []
    return Placement(PromptSize(prompt, None), HeldContext(held, None, 256) if held else None,
                     d1 if own else None, [Candidate("p0", "p0", prefill_inflight)], [d0, d1],
                     hosts, 512, max_backlog)


def test_the_planner_asks_once_about_a_long_append_and_decides_on_the_answer():
    """The proxy and the simulator execute one planner: a long append needs the first-ranked
    prefill pod's share of the context; the answer decides, and an answer of None (no index)
    means P/D."""
    p = _placement(3000 + 2000)
    assert plan_local_pod(p) == LocalPlan(ask="p0")
    # the prefill pod would compute the whole prompt (it lacks what d1 computed locally)
    assert plan_local_pod(p, 5000).pod == p.own
    assert plan_local_pod(p, 2100) == LocalPlan()  # it holds nearly all: P/D
    assert plan_local_pod(p, None) == LocalPlan()
    # a short append, an unsized prompt or no held context is decided without asking
    assert plan_local_pod(_placement(3200)) == LocalPlan(_placement(3200).own)
    assert plan_local_pod(_placement(None)) == LocalPlan()
    assert plan_local_pod(_placement(5000, held=None)) == LocalPlan()
    assert repr(UNASKED) == "UNASKED"


def test_the_planner_places_a_first_turn_by_backlog_and_idle_hosts():
    saturated = _placement(3000, own=False, held=None, prefill_inflight=4, max_backlog=4)
    assert plan_local_pod(saturated).pod == saturated.decode[0]  # the first-ranked decode pod
    idle = _placement(3000, own=False, held=None, decode_inflight=1, host_inflight=0)
    assert plan_local_pod(idle).pod == idle.hosts[0]  # every decode pod busy, the host idle
    busy_host = _placement(3000, own=False, held=None, decode_inflight=1, host_inflight=1)
    assert plan_local_pod(busy_host) == LocalPlan()
    idle_decode = _placement(3000, own=False, held=None, host_inflight=0)
    assert plan_local_pod(idle_decode) == LocalPlan()  # a decode pod is free: P/D


def _balanced(prompt: int, *, own_queued: int = 0, own_inflight: int = 0, held: int = 3000,
              host_queued: int = 0, other_inflight: int = 1, own: bool = True,
              balance: int = 1024) -> Placement:
    """d1 is the session's own pod, p0 the prefill pod hosting sessions, d0 the other decode
    pod; queues in prompt tokens, a turn in flight weighing 2,048."""
    d0 = Candidate("d0", "d0", other_inflight)
    d1 = Candidate("d1", "d1", own_inflight, own_queued)
    p0 = Candidate("p0", "p0", 1 if host_queued else 0, host_queued)
    return Placement(PromptSize(prompt, None), HeldContext(held, None, 256) if own else None,
                     d1 if own else None, [p0], [d0, d1] if own else [d0], [p0], 512, 0,
                     balance, 2048)


def test_a_backed_up_own_pod_asks_where_the_context_is_and_spills_the_turn_there():
    """The session's pod has a 6,000-token prefill and one turn queued: the short append
    (484 new tokens) waits behind 8,532 tokens of work there, against the idle prefill pod's
    share of the context."""
    p = _balanced(3300, own_queued=6000, own_inflight=1)
    assert plan_local_pod(p) == LocalPlan(ask="p0")
    assert plan_local_pod(p, 700).pod == p.hosts[0]  # it holds most of the context
    assert plan_local_pod(p, 3300).pod == p.hosts[0]  # even all of it beats the wait
    assert plan_local_pod(p, None).pod == p.own  # no index: stay
    # a queue the move would not beat: stay, after asking
    assert plan_local_pod(_balanced(3300, own_queued=1500, own_inflight=1), 3300).pod.name == "d1"


def test_an_own_pod_not_backed_up_keeps_its_turn_without_a_question():
    idle = _balanced(3300)
    assert plan_local_pod(idle) == LocalPlan(idle.own)
    # the other pods are as busy as the own one: nothing to gain, nothing asked
    even = _balanced(3300, own_inflight=1, own_queued=4000, host_queued=4000, other_inflight=3)
    assert plan_local_pod(even) == LocalPlan(even.own)
    # balancing off: the own pod, however backed up
    off = _balanced(3300, own_queued=60000, own_inflight=4, balance=0)
    assert plan_local_pod(off) == LocalPlan(off.own)


def test_the_least_loaded_other_pod_is_the_one_asked():
    """The prefill pod is busier than the other decode pod: the decode pod is asked."""
    p = _balanced(3300, own_queued=8000, own_inflight=1, host_queued=5000, other_inflight=0)
    assert plan_local_pod(p) == LocalPlan(ask="d0")
    assert plan_local_pod(p, 3300).pod == p.decode[0]


def test_a_long_appends_answer_about_the_prefill_pod_settles_the_spill_too():
    """A long append asks about the prefill pod; kept local (the prefill pod lacks the
    context), the same answer decides the spill, with no second question."""
    p = _balanced(3000 + 2000, own_queued=9000, own_inflight=2)
    assert plan_local_pod(p) == LocalPlan(ask="p0")
    assert plan_local_pod(p, 5000).pod == p.hosts[0]  # 5,000 + 1,024 < 2 x 2,048 + 9,000 + 2,184
    kept = _balanced(5000, own_queued=100, own_inflight=1)
    assert plan_local_pod(kept, 5000) == LocalPlan(kept.own)


def test_a_first_turn_runs_where_less_work_is_queued():
    busy_prefill = _balanced(3000, own=False, host_queued=6000, other_inflight=0)
    assert plan_local_pod(busy_prefill).pod == busy_prefill.decode[0]
    # the prefill pod's queue is shorter than the decode pod's: whole there, where a P/D
    # turn's decode stage would queue behind the decode pod's work
    busy_decode = _balanced(3000, own=False, host_queued=1000, other_inflight=2)
    assert plan_local_pod(busy_decode).pod == busy_decode.hosts[0]
    # nothing queued anywhere: P/D, the prefill pod's job
    assert plan_local_pod(_balanced(3000, own=False, other_inflight=0)) == LocalPlan()


def test_the_orchestrator_spills_a_backed_up_sessions_turn_to_the_prefill_pod():
    """--balance-tokens through the orchestrator: the session's decode pod computes a
    6,000-token prompt for another turn; the idle prefill pod holds the session's context (by
    the kvindex), so the short append runs whole there, the P/D pairs behind it. Without the
    backlog the own pod keeps the turn and the kvindex is not asked."""
    state = SessionState(last_decode_pod="http://d0", prompt_tokens=3000,
                         chunk_hashes=[f"{i:064x}" for i in range(11)])
    index = PrefixIndex(11)
    backed_up = dict(decode_inflight=(1, 1), decode_queued=(6000, 0), balance=1024)
    pairs = attempts_for(state, 3200, kvindex=index, **backed_up)  # type: ignore[arg-type]
    assert pairs[0] == ("http://p0", None) and index.lookups >= 1
    assert pairs[1][0] == "http://p0" and pairs[1][1] is not None
    calm = PrefixIndex(11)
    assert attempts_for(state, 3200, kvindex=calm, balance=1024)[0] == ("http://d0", None)
    assert calm.lookups == 0
    off = attempts_for(state, 3200, kvindex=PrefixIndex(11), decode_inflight=(1, 1),
                       decode_queued=(6000, 0))
    assert off[0] == ("http://d0", None)


def test_a_pd_prefill_counts_its_prompt_in_the_prefill_pods_queue():
    """While a P/D turn's prefill runs, the prefill pod's queue holds its prompt (a first turn
    arriving then weighs it against the decode pods' queues, --balance-tokens); after it,
    nothing."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    seen: list[int] = []

    def app(prefill: bool) -> web.Application:
        async def completions(request: web.Request) -> web.Response:
            await request.json()
            if prefill:
                seen.append(orch.pool.prefill_candidates()[0].queued_prompt_tokens)
                return web.json_response({"choices": [{"text": "", "finish_reason": "length"}],
                                          "kv_transfer_params": {"ready": True}})
            return web.json_response({"choices": [{"text": "ok", "finish_reason": "stop"}]})

        application = web.Application()
        application.router.add_post("/v1/completions", completions)
        return application

    async def go() -> None:
        nonlocal orch
        async with TestServer(app(True)) as p0, TestServer(app(False)) as d0, \
                aiohttp.ClientSession() as http:
            urls = [str(s.make_url("")).rstrip("/") for s in (p0, d0)]
            settings = ProxySettings(prefill_urls=urls[:1], decode_urls=urls[1:],
                                     balance_tokens=1024)
            orch = Orchestrator(settings, PodPool(settings.prefill_urls, settings.decode_urls,
                                                  None), None, make_policy("kv-aware"), http,
                                ProxyMetrics(CollectorRegistry()))
            await orch.handle(Turn(endpoint="/v1/completions", body={"prompt": [1] * 3000},
                                   session_id="s", session_key="s"))
            assert orch.pool.prefill_candidates()[0].queued_prompt_tokens == 0

    orch: Orchestrator
    asyncio.run(go())
    assert seen == [3000]
