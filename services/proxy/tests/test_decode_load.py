"""Decode pods are balanced by the work queued on them, not by their turn counts alone.

Real HTTP: the proxy's orchestrator in front of aiohttp servers standing in for the pods (they
answer with the OpenAI shapes the proxy reads; how long each takes is the point here).
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry

from agentserving.proxy.metrics import ProxyMetrics
from agentserving.proxy.orchestrator import Orchestrator, Turn
from agentserving.proxy.pods import PodPool
from agentserving.proxy.routing import (
    Candidate,
    LeastLoaded,
    RouteInput,
    affinity_order,
    make_policy,
)
from agentserving.proxy.settings import ProxySettings


def test_least_loaded_weighs_queued_prompt_tokens_against_turns_in_flight():
    policy = LeastLoaded(turn_tokens=2048)
    computing = Candidate("d0", "u", inflight=1, queued_prompt_tokens=6000)
    decoding = Candidate("d1", "u", inflight=2)
    assert policy.rank(RouteInput("s", [computing, decoding]))[0].name == "d1"
    short = Candidate("d0", "u", inflight=1, queued_prompt_tokens=300)
    assert policy.rank(RouteInput("s", [short, decoding]))[0].name == "d0"
    # nothing queued anywhere: turns in flight alone, as before
    assert policy.rank(RouteInput("s", [Candidate("d0", "u", 2), Candidate("d1", "u", 1)])
                       )[0].name == "d1"


def test_a_queued_prompt_outlives_a_registry_refresh_of_its_pod():
    pool = PodPool([], ["http://d0"], None)
    queued = pool.queue_prompt("http://d0", 4000)
    assert pool.decode_candidates()[0].queued_prompt_tokens == 4000
    queued.done()
    queued.done()  # idempotent: a failure path and the stream's end may both call it
    assert pool.decode_candidates()[0].queued_prompt_tokens == 0
    assert pool.queue_prompt("http://gone", 10).tokens == 10  # unknown pod: counted nowhere


def _pods_app(name: str, served: dict[str, str], delays: dict[str, float]) -> web.Application:
    """A pod: prefill requests (``do_remote_decode``) and whole turns, each delayed by the
    turn's ``user``; a stream sends its headers at once (as vLLM does) and its first token
    after the delay, then holds on a while."""

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        user = body["user"]
        if not body.get("stream"):
            await asyncio.sleep(delays.get(user, 0.0))
        if body.get("kv_transfer_params", {}).get("do_remote_decode"):
            return web.json_response({"choices": [{"text": "", "finish_reason": "length"}],
                                      "kv_transfer_params": {"ready": True}})
        served[user] = name
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "ok", "finish_reason": "stop"}]})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(delays.get(user, 0.0))
        for text in ("o", "k"):
            event = {"choices": [{"text": text, "index": 0, "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
            await asyncio.sleep(0.4)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    application = web.Application()
    application.router.add_post("/v1/completions", completions)
    return application


def _turn(sid: str, tokens: int, stream: bool = False) -> Turn:
    return Turn(endpoint="/v1/completions", session_id=sid, session_key=sid,
                body={"prompt": [1] * tokens, "user": sid, "stream": stream})


def test_a_first_turn_avoids_the_decode_pod_computing_a_long_prompt():
    """The prefill pod is busy (``hold``'s prefill), so first turns run whole on decode pods.
    ``long`` (6,000 tokens) takes one; ``hold``'s reservation takes the other. Both have one
    turn in flight; ``short``'s rendezvous order names long's pod first, so by turn counts it
    would queue behind long's prompt. By queued tokens it goes to the other pod."""

    async def go() -> None:
        served: dict[str, str] = {}
        delays = {"hold": 1.5, "long": 1.0}
        async with TestServer(_pods_app("p0", served, delays)) as p0, \
                TestServer(_pods_app("d0", served, delays)) as d0, \
                TestServer(_pods_app("d1", served, delays)) as d1, \
                aiohttp.ClientSession() as http:
            urls = [str(s.make_url("")).rstrip("/") for s in (p0, d0, d1)]
            names = dict(zip(urls, ("p0", "d0", "d1"), strict=True))
            settings = ProxySettings(prefill_urls=urls[:1], decode_urls=urls[1:],
                                     max_prefill_backlog=1,
                                     activity_half_life_s=1e6)  # no fading within the test
            pool = PodPool(settings.prefill_urls, settings.decode_urls, None)
            orch = Orchestrator(settings, pool, None, make_policy("kv-aware"), http,
                                ProxyMetrics(CollectorRegistry()))
            hold = asyncio.create_task(orch.handle(_turn("hold", 3000)))
            await asyncio.sleep(0.2)  # hold is in its prefill stage, its decode pod reserved
            long = asyncio.create_task(orch.handle(_turn("long", 6000)))
            await asyncio.sleep(0.2)  # long is computing on the other decode pod
            loads = {names[c.url]: c for c in pool.decode_candidates()}
            assert [c.inflight for c in loads.values()] == [1, 1]
            long_pod = next(n for n, c in loads.items() if c.queued_prompt_tokens == 6000)
            decoders = [Candidate(u, u) for u in urls[1:]]
            short = next(f"s{k}" for k in range(100)
                         if names[affinity_order(f"s{k}", decoders)[0].url] == long_pod)
            await orch.handle(_turn(short, 500))
            await asyncio.gather(hold, long)
            assert served["long"] == long_pod
            assert served[short] != long_pod, served
            assert all(c.queued_prompt_tokens == 0 and c.inflight == 0
                       for c in pool.decode_candidates())
            # the work each pod was given, for placing new sessions: a turn's fixed share,
            # plus the prompt of a turn run whole (long; short beside hold's P/D turn)
            turn = settings.load_penalty_tokens
            work = {names[c.url]: orch.activity.level(c.name) for c in pool.decode_candidates()}
            other = next(n for n in work if n != long_pod)
            assert (work[long_pod], work[other]) == pytest.approx(
                (turn + 6000, turn + turn + 500), rel=1e-3)

    asyncio.run(go())


def test_a_streamed_turn_stops_counting_its_prompt_at_its_first_token():
    async def go() -> None:
        served: dict[str, str] = {}
        async with TestServer(_pods_app("d0", served, {"a": 0.5})) as d0, \
                aiohttp.ClientSession() as http:
            url = str(d0.make_url("")).rstrip("/")
            settings = ProxySettings(prefill_urls=[url])
            pool = PodPool(settings.prefill_urls, [], None)
            orch = Orchestrator(settings, pool, None, make_policy("kv-aware"), http,
                                ProxyMetrics(CollectorRegistry()))
            resp = await orch.handle(_turn("a", 3000, stream=True))
            body = resp.body_iterator
            assert pool.prefill_candidates()[0].queued_prompt_tokens == 3000
            first = await anext(body)
            assert first.startswith(b"data: ")
            pod = pool.prefill_candidates()[0]
            assert (pod.queued_prompt_tokens, pod.inflight) == (0, 1)  # computed, decoding
            async for _ in body:
                pass
            pod = pool.prefill_candidates()[0]
            assert (pod.queued_prompt_tokens, pod.inflight) == (0, 0)

    asyncio.run(go())
