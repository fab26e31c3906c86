"""The orchestrator's routing step and JSON codec, without processes: a stand-in kvindex
counts lookups."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from agentserving.core.schemas import LookupResponse, PodPrefix, SessionRoute
from agentserving.kvindex.app import create_app as create_kvindex
from agentserving.kvindex.index.memory import InMemoryIndex, InMemorySessionStore
from agentserving.kvindex.settings import KvindexSettings
from agentserving.proxy.jsonio import dumps, loads
from agentserving.proxy.kvindex_http import AioKvindexClient
from agentserving.proxy.metrics import ProxyMetrics
from agentserving.proxy.orchestrator import Orchestrator, Turn
from agentserving.proxy.pods import PodPool
from agentserving.proxy.routing import make_policy
from agentserving.proxy.sessions import SessionState
from agentserving.proxy.settings import ProxySettings
from testkit.servers import ThreadedServer, free_port


class CountingKvindex:
    """Answers every lookup with the last pod holding the whole chain."""

    def __init__(self, best: str) -> None:
        self.best = best
        self.lookups = 0

    async def lookup(self, req):  # type: ignore[no-untyped-def]
        self.lookups += 1
        n = len(req.chunk_hashes)
        return LookupResponse(num_chunks=n, best_pod=self.best, pods=[
            PodPrefix(pod=self.best, prefix_chunks=n, tiers={}, score=n)])


def route(prefill: list[str], best: str) -> tuple[list[str], int]:
    async def go() -> tuple[list[str], int]:
        kvindex = CountingKvindex(best)
        settings = ProxySettings(prefill_urls=prefill, decode_urls=["http://d0"])
        async with aiohttp.ClientSession() as http:
            pool = PodPool(prefill, ["http://d0"], None)
            orch = Orchestrator(settings, pool, kvindex, make_policy("kv-aware"),  # type: ignore[arg-type]
                                http, ProxyMetrics(CollectorRegistry()))
            state = SessionState(chunk_hashes=["a" * 64, "b" * 64])
            turn = Turn(endpoint="/v1/completions", body={"prompt": [1]}, session_id="s",
                        session_key="s")
            order = (await orch._route(turn, state)).prefill
        return [c.name for c in order], kvindex.lookups

    return asyncio.run(go())


def test_two_prefill_pods_are_ranked_by_the_kvindex():
    order, lookups = route(["http://p0", "http://p1"], best="http://p1")
    assert lookups == 1 and order[0] == "http://p1"


def test_one_prefill_pod_needs_no_lookup():
    order, lookups = route(["http://p0"], best="http://p0")
    assert lookups == 0 and order == ["http://p0"]


@pytest.mark.parametrize("obj", [{"prompt": list(range(5000)), "stream": True,
                                  "kv_transfer_params": {"chunk_hashes": ["ab"], "x": None}},
                                 {"text": "é ✓", "n": -1.5}])
def test_json_codec_round_trips(obj):
    assert loads(dumps(obj)) == obj


def test_json_codec_rejects_malformed_input_as_value_error():
    with pytest.raises(ValueError):
        loads(b"{oops")


def test_stream_lines_survive_any_chunking_and_crlf():
    """SSE lines split across network reads, with \\n or \\r\\n, come out whole."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from agentserving.proxy.upstream import open_stream

    payload = b'data: {"a": 1}\r\n\r\ndata: {"b": [1, 2, 3]}\n\ndata: [DONE]\n\ntail'

    async def sse(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(0, len(payload), 5):  # odd-sized pieces, each flushed on its own
            await resp.write(payload[i:i + 5])
            await asyncio.sleep(0)
        await resp.write_eof()
        return resp

    async def go() -> list[str]:
        app = web.Application()
        app.router.add_post("/v1/completions", sse)
        async with TestServer(app) as server, aiohttp.ClientSession() as http:
            reply = await open_stream(http, "p0", str(server.make_url("/v1/completions")),
                                      {"prompt": [1]})
            lines = [line async for line in reply.aiter_lines()]
            await reply.aclose()
        return lines

    assert asyncio.run(go()) == ['data: {"a": 1}', "", 'data: {"b": [1, 2, 3]}', "",
                                 "data: [DONE]", "", "tail"]


def test_a_pd_turn_reports_its_prefill_pods_cache_hit_and_prompt_sources():
    """The decode pod pulled the whole prompt; the caller hears what the prefill pod read
    from its tiers and computed, streamed or not, and nothing where the pod said nothing."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from agentserving.proxy.upstream import PrefillReport, TurnOutcome, open_stream, relay_sse

    prefill = {"tokens": {"device": 0, "cpu": 256, "disk": 512, "remote": 0, "computed": 40},
               "load_s": 0.2, "disk_read_s": 0.15, "fell_back": False}
    own = {"tokens": {"device": 0, "cpu": 0, "disk": 0, "remote": 768, "computed": 40}}
    report = PrefillReport(768, prefill)
    events = [{"choices": [{"delta": {"content": "a"}, "finish_reason": None}]},
              {"choices": [{"delta": {}, "finish_reason": "stop"}],
               "kv_transfer_params": {"chunk_hashes": ["ab"], "prompt_sources": own}},
              {"choices": [], "usage": {"prompt_tokens": 808, "completion_tokens": 1,
                                        "prompt_tokens_details": {"cached_tokens": 768}},
               "kv_transfer_params": {"chunk_hashes": ["ab"], "prompt_sources": own}}]
    body = b"".join(b"data: " + dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"

    async def sse(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(body)
        await resp.write_eof()
        return resp

    async def go() -> tuple[list[dict], TurnOutcome]:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", sse)
        outcome = TurnOutcome()
        async with TestServer(app) as server, aiohttp.ClientSession() as http:
            reply = await open_stream(http, "d0", str(server.make_url("/v1/chat/completions")),
                                      {"messages": []})
            out = [loads(chunk[6:]) async for chunk in relay_sse(reply, outcome, report)
                   if chunk.startswith(b"data: {")]
            await reply.aclose()
        return out, outcome

    out, outcome = asyncio.run(go())
    assert "kv_transfer_params" not in out[0] and "usage" not in out[0]
    assert out[1]["kv_transfer_params"] == {"chunk_hashes": ["ab"], "prompt_sources": prefill}
    assert out[2]["kv_transfer_params"]["prompt_sources"] == prefill
    assert out[2]["usage"]["prompt_tokens_details"]["cached_tokens"] == 768
    assert outcome.prompt_sources == own  # what the decode pod itself said, read before
    # a blocking answer; a pod that reports no sources (no connector) gets none added
    blocking = {"usage": {"prompt_tokens": 808}, "kv_transfer_params": {"chunk_hashes": []}}
    assert report.patch(blocking)
    assert blocking["usage"]["prompt_tokens_details"] == {"cached_tokens": 768}
    assert "prompt_sources" not in blocking["kv_transfer_params"]
    assert not PrefillReport(None, prefill).patch({"choices": []})


def test_a_dead_upstream_is_a_retryable_failure():
    from agentserving.proxy.upstream import UpstreamFailed, post_json
    from testkit.servers import free_port

    async def go() -> None:
        async with aiohttp.ClientSession() as http:
            await post_json(http, "p0", f"http://127.0.0.1:{free_port()}/v1/completions", {})

    with pytest.raises(UpstreamFailed, match="p0"):
        asyncio.run(go())


class InOrder:
    """Ranks the pods as the pool lists them: the test decides which one is tried first."""

    name = "in-order"

    def rank(self, inp):  # type: ignore[no-untyped-def]
        return list(inp.candidates)


@pytest.mark.parametrize("stream", [False, True])
def test_a_turn_moved_off_a_dead_pod_names_it_in_a_header(stream):
    """The caller gets its answer from the live pod and, in ``x-agentserving-retried``, the
    pod the proxy gave up on first: a retry the caller never saw is still visible (the fault
    bench counts them; without the header a saved turn looks like one that met no fault)."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from agentserving.proxy.orchestrator import H_RETRIED
    from testkit.servers import free_port

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "ok", "finish_reason": "stop"}]})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"text": "ok", "finish_reason": "stop"}]}\n\n'
                         b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def go() -> tuple[int, dict[str, str], bytes, str]:
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        dead = f"http://127.0.0.1:{free_port()}"
        async with TestServer(app) as server, aiohttp.ClientSession() as http:
            live = str(server.make_url("")).rstrip("/")
            settings = ProxySettings(prefill_urls=[dead, live])
            orch = Orchestrator(settings, PodPool([dead, live], [], None), None, InOrder(),
                                http, ProxyMetrics(CollectorRegistry()))
            turn = Turn(endpoint="/v1/completions", body={"prompt": [1], "stream": stream},
                        session_id="s", session_key="s")
            resp = await orch.handle(turn)
            if stream:
                content = b"".join([c async for c in resp.body_iterator])
            else:
                content = resp.body
            return resp.status_code, dict(resp.headers), content, dead

    status, headers, content, dead = asyncio.run(go())
    assert status == 200 and b"ok" in content
    assert headers[H_RETRIED] == dead


def test_shared_session_records_are_adopted_only_when_newer_and_a_dead_kvindex_is_no_error():
    """--shared-sessions against a real kvindex over HTTP: a replica that saw fewer turns takes
    the record, one that saw as many keeps its own; the record is the tenant's; with the
    kvindex gone the turn routes on what the replica knows."""
    server = ThreadedServer(create_kvindex(KvindexSettings(), InMemoryIndex(),
                                           InMemorySessionStore()))

    async def go(url: str) -> list[SessionState]:
        async with aiohttp.ClientSession() as http:
            kv = AioKvindexClient(url, 1.0)
            orch = Orchestrator(ProxySettings(shared_sessions=True), PodPool([], [], None), kv,
                                make_policy("kv-aware"), http, ProxyMetrics(CollectorRegistry()))
            record = SessionRoute(turns=3, chunk_hashes=["ab" * 16], last_pod="p1",
                                  last_decode_pod="d1", prompt_tokens=900)
            if url == server.url:
                await kv.for_tenant("acme").put_route("s", record)
            states = []
            for tenant, seen in (("acme", 1), ("acme", 3), ("beta", 0)):
                state = SessionState(turns=seen, last_decode_pod="d0")
                await orch._adopt_shared_route(
                    Turn(endpoint="/v1/completions", body={"prompt": [1]}, session_id="s",
                         session_key=f"{tenant}/s", tenant=tenant), state)
                states.append(state)
            await kv.aclose()
            return states

    try:
        newer, same, other_tenant = asyncio.run(go(server.url))
    finally:
        server.stop()
    assert (newer.turns, newer.last_decode_pod, newer.prompt_tokens) == (3, "d1", 900)
    assert newer.chunk_hashes == ["ab" * 16] and newer.last_pod == "p1"
    assert (same.turns, same.last_decode_pod) == (3, "d0")  # its own, as current
    assert (other_tenant.turns, other_tenant.last_decode_pod) == (0, "d0")  # none for beta
    down = asyncio.run(go(f"http://127.0.0.1:{free_port()}"))
    assert [(s.turns, s.last_decode_pod) for s in down] == [(1, "d0"), (3, "d0"), (0, "d0")]
