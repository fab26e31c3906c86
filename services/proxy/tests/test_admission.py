"""Admission at the fleet's door (--admit-per-pod): the fewest tokens to compute go first."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry

from agentserving.proxy.admission import AdmissionGate, Admitted, Waiter, next_waiter, upcoming
from agentserving.proxy.metrics import ProxyMetrics
from agentserving.proxy.orchestrator import H_ADMISSION, Orchestrator, Turn
from agentserving.proxy.pods import PodPool
from agentserving.proxy.routing import make_policy
from agentserving.proxy.settings import ProxySettings


def _waiters(*specs: tuple[int, float]) -> list[Waiter]:
    return [Waiter(cost, since, seq, future=None) for seq, (cost, since) in enumerate(specs)]


def test_the_fewest_tokens_go_first_and_the_earlier_on_a_tie():
    assert next_waiter(_waiters((3000, 0), (400, 0), (900, 0)), 1.0, 30) == \
        (1, Admitted.SHORTEST)
    assert next_waiter(_waiters((500, 0), (500, 0)), 1.0, 30) == (0, Admitted.SHORTEST)
    assert next_waiter([], 1.0, 30) is None


def test_a_turn_waiting_past_the_bound_goes_before_shorter_ones():
    waiters = _waiters((200, 5.0), (7000, 0.0), (6000, 1.0))
    assert next_waiter(waiters, 10.5, 10) == (1, Admitted.AGED)  # both aged: the earlier
    assert next_waiter(waiters, 9.0, 10) == (0, Admitted.SHORTEST)


def test_the_next_to_go_are_the_aged_by_arrival_then_the_shortest():
    waiters = _waiters((200, 5.0), (7000, 0.0), (6000, 1.0), (100, 9.5))
    assert upcoming(waiters, 11.0, 10, 3) == [1, 2, 3]  # two aged, then the shortest
    assert upcoming(waiters, 9.0, 10, 9) == [3, 0, 2, 1]
    assert upcoming(waiters, 9.0, 10, 0) == [] and upcoming([], 9.0, 10, 2) == []
    # the first of them is the one next_waiter admits
    assert next_waiter(waiters, 11.0, 10)[0] == upcoming(waiters, 11.0, 10, 1)[0]


def test_a_waiting_turn_is_told_once_when_it_is_among_the_next_to_go():
    async def go() -> None:
        told: list[int] = []
        clock = Clock()
        gate = AdmissionGate(1, 30.0, lambda: 1, clock=clock, lookahead=1, retell_s=10.0)
        held = await gate.admit(100, on_next=lambda: told.append(100))
        assert told == []  # went at once: nothing to read ahead for
        waits = [asyncio.create_task(gate.admit(c, on_next=lambda c=c: told.append(c)))
                 for c in (900, 300, 600)]
        await asyncio.sleep(0)
        # one place ahead (lookahead 1 x 1 pod): 900, then 300 were next as they came; 600
        # came behind 300 (900 was told already)
        assert told == [900, 300]
        held.release()  # 300 goes; 600 is next now
        await asyncio.sleep(0)
        assert told == [900, 300, 600] and waits[1].done()
        # 900, told long ago, is about to have waited 30 s: it goes first, and is told again
        clock.now = 28.5
        (await waits[1]).release()
        await asyncio.sleep(0)
        assert waits[2].done() and told == [900, 300, 600, 900]
        for t in (waits[2], waits[0]):  # each place freed in turn
            (await t).release()
            await asyncio.sleep(0)
        assert told == [900, 300, 600, 900]

    asyncio.run(go())


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_gate_admits_up_to_its_places_then_the_shortest_waiting():
    async def go() -> None:
        pods = [2]
        clock = Clock()
        gate = AdmissionGate(1, 30.0, lambda: pods[0], clock=clock)
        first = [await gate.admit(9000), await gate.admit(9000)]
        assert [t.how for t in first] == [Admitted.FREE, Admitted.FREE]
        waits = {cost: asyncio.create_task(gate.admit(cost)) for cost in (3000, 500, 1500)}
        await asyncio.sleep(0)
        assert gate.waiting == 3 and not any(t.done() for t in waits.values())
        clock.now = 2.0
        first[0].release()
        first[0].release()  # idempotent: frees one place only
        await asyncio.sleep(0)
        assert [c for c, t in waits.items() if t.done()] == [500]
        ticket = waits[500].result()
        assert ticket.how is Admitted.SHORTEST and ticket.waited_s == 2.0
        pods[0] = 3  # a pod joined: one more place, taken at the next admit or release
        ticket.release()
        await asyncio.sleep(0)
        assert sorted(c for c, t in waits.items() if t.done()) == [500, 1500, 3000]
        assert gate.admitted == 3 and gate.waiting == 0

    asyncio.run(go())


def test_a_caller_gone_while_waiting_takes_no_place():
    async def go() -> None:
        gate = AdmissionGate(1, 30.0, lambda: 1)
        held = await gate.admit(100)
        gone = asyncio.create_task(gate.admit(50))
        later = asyncio.create_task(gate.admit(5000))
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.sleep(0)
        held.release()
        await asyncio.sleep(0)
        assert later.done() and later.result().how is Admitted.SHORTEST
        assert gate.admitted == 1 and gate.waiting == 0

    asyncio.run(go())


def _pod(events: list[tuple[str, int]], first_token_s: float, rest_s: float
         ) -> web.Application:
    """A pod that records each prompt's size when it is sent it and when it has answered,
    streams a first token after ``first_token_s`` and ends the stream ``rest_s`` later."""
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = len(body["prompt"])
        events.append(("sent", n))
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(first_token_s)
        await resp.write(b'data: {"choices": [{"text": "a", "index": 0}]}\n\n')
        await asyncio.sleep(rest_s)
        await resp.write(b'data: {"choices": [{"text": "b", "index": 0, '
                         b'"finish_reason": "stop"}]}\n\ndata: [DONE]\n\n')
        events.append(("answered", n))
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


async def _burst(per_pod: int, sizes: list[int], rest_s: float = 0.0
                 ) -> tuple[list[tuple[str, int]], list[str]]:
    """One pod; a 4000-token turn that keeps it busy, then ``sizes`` arriving together, all
    streamed through the orchestrator. Returns what the pod saw (``_pod``) and each turn's
    admission header."""
    events: list[tuple[str, int]] = []
    async with TestServer(_pod(events, 0.4, rest_s)) as pod, aiohttp.ClientSession() as http:
        url = str(pod.make_url("")).rstrip("/")
        settings = ProxySettings(prefill_urls=[url], admit_per_pod=per_pod)
        orch = Orchestrator(settings, PodPool([url], [], None), None, make_policy("kv-aware"),
                            http, ProxyMetrics(CollectorRegistry()))

        async def turn(sid: str, n: int) -> str:
            resp = await orch.handle(Turn(
                endpoint="/v1/completions", session_id=sid, session_key=sid,
                body={"prompt": [7] * n, "max_tokens": 2, "stream": True}))
            async for _ in resp.body_iterator:
                pass
            return resp.headers.get(H_ADMISSION, "")

        busy = asyncio.create_task(turn("busy", 4000))
        await asyncio.sleep(0.15)
        rest = [asyncio.create_task(turn(f"s{i}", n)) for i, n in enumerate(sizes)]
        headers = [await busy, *[await t for t in rest]]
    return events, headers


def _sent(events: list[tuple[str, int]]) -> list[int]:
    return [n for what, n in events if what == "sent"]


def test_the_proxy_sends_the_shortest_waiting_turn_when_the_pod_frees():
    events, headers = asyncio.run(_burst(1, [3000, 500, 1500]))
    assert _sent(events) == [4000, 500, 1500, 3000]
    assert headers[0].startswith("free;")
    assert all(h.startswith("shortest;") for h in headers[1:]), headers


def test_without_admission_the_pod_gets_turns_as_they_arrive():
    events, headers = asyncio.run(_burst(0, [3000, 500, 1500]))
    assert _sent(events) == [4000, 3000, 500, 1500]
    assert headers == ["", "", "", ""]


def test_a_streamed_turn_frees_its_place_at_its_first_token():
    """The next turn is sent while the first still streams its answer: the place is for
    computing a prompt, not for decoding."""
    events, _ = asyncio.run(_burst(1, [500], rest_s=0.5))
    assert events == [("sent", 4000), ("sent", 500), ("answered", 4000), ("answered", 500)]


def test_a_pd_turn_frees_its_place_when_its_prefill_pod_answers():
    """Two places (a prefill and a decode pod); three first turns, each P/D. The third is let in
    when the first two's prompts are computed on the prefill pod, before either decode stage
    sends a first token: the decode stage computes no prompt."""
    events: list[tuple[str, str]] = []

    def app(prefill: bool) -> web.Application:
        async def completions(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            if prefill:
                events.append(("prefill", body["user"]))
                await asyncio.sleep(0.2)
                return web.json_response({"choices": [{"text": "", "finish_reason": "length"}],
                                          "kv_transfer_params": {"ready": True}})
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            await asyncio.sleep(0.8)
            events.append(("first token", body["user"]))
            await resp.write(b'data: {"choices": [{"text": "a", "index": 0, '
                             b'"finish_reason": "stop"}]}\n\ndata: [DONE]\n\n')
            return resp

        application = web.Application()
        application.router.add_post("/v1/completions", completions)
        return application

    async def go() -> None:
        async with TestServer(app(True)) as p0, TestServer(app(False)) as d0, \
                aiohttp.ClientSession() as http:
            urls = [str(s.make_url("")).rstrip("/") for s in (p0, d0)]
            settings = ProxySettings(prefill_urls=urls[:1], decode_urls=urls[1:],
                                     admit_per_pod=1)
            orch = Orchestrator(settings, PodPool(urls[:1], urls[1:], None), None,
                                make_policy("kv-aware"), http, ProxyMetrics(CollectorRegistry()))

            async def turn(sid: str) -> None:
                resp = await orch.handle(Turn(
                    endpoint="/v1/completions", session_id=sid, session_key=sid,
                    body={"prompt": [7] * 600, "max_tokens": 2, "stream": True, "user": sid}))
                async for _ in resp.body_iterator:
                    pass

            await asyncio.gather(*(turn(sid) for sid in ("a", "b", "c")))
            assert orch.admission.admitted == 0

    asyncio.run(go())
    assert [what for what, _ in events[:3]] == ["prefill"] * 3, events
