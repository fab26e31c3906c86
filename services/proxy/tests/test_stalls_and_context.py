"""The pure rules behind stall detection (deadlines from flags or from the pods' observed
latency) and the context-length check (what the proxy may refuse without a tokenizer)."""

from __future__ import annotations

import pytest

from agentserving.proxy.cli import settings_from_params
from agentserving.proxy.context_limit import context_error
from agentserving.proxy.disagg import PromptSize
from agentserving.proxy.settings import ProxySettings
from agentserving.proxy.stalls import (
    LatencyWindow,
    StallDeadlines,
    StallPolicy,
    adaptive_deadline,
    policy_from,
)

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


# ------------------------------------------------------------------ context length

def test_max_tokens_past_the_context_alone_is_refused_whatever_the_prompt():
    err = context_error(CHAT, {"max_tokens": 4097}, PromptSize(None, 10), 4096)
    assert err is not None and err.status_code == 400 and err.param == "max_tokens"
    assert "4096" in err.message and err.message.startswith("max_tokens:")
    assert context_error(CHAT, {"max_tokens": 4096}, PromptSize(None, 10), 4096) is None


def test_chat_names_max_completion_tokens_when_that_is_the_field_given():
    err = context_error(CHAT, {"max_completion_tokens": 9000}, PromptSize(None, 5), 4096)
    assert err is not None and err.param == "max_completion_tokens"
    # on /v1/completions only max_tokens bounds the answer
    assert context_error(COMPLETIONS, {"max_completion_tokens": 9000}, PromptSize(None, 5),
                         4096) is None


def test_a_token_id_prompt_is_checked_exactly():
    assert context_error(COMPLETIONS, {"max_tokens": 96}, PromptSize(4000, None), 4096) is None
    err = context_error(COMPLETIONS, {"max_tokens": 98}, PromptSize(3999, None), 4096)
    assert err is not None and err.param == "max_tokens" and "4097" in err.message
    # no max_tokens: refused only when no completion token fits
    assert context_error(COMPLETIONS, {}, PromptSize(4095, None), 4096) is None
    err = context_error(COMPLETIONS, {}, PromptSize(4096, None), 4096)
    assert err is not None and err.param == "prompt"


def test_an_estimated_text_prompt_is_left_to_the_engine():
    # a huge text prompt with a small max_tokens: maybe impossible, not certainly
    assert context_error(CHAT, {"max_tokens": 100}, PromptSize(None, 10**6), 4096) is None


@pytest.mark.parametrize("value", [None, "9999", True, -1, 2.5])
def test_no_limit_known_or_a_malformed_max_tokens_refuses_nothing_here(value):
    assert context_error(CHAT, {"max_tokens": 10**9}, PromptSize(10**6, None), None) is None
    assert context_error(COMPLETIONS, {"max_tokens": value}, PromptSize(10, None), 4096) is None


# ------------------------------------------------------------------ stall deadlines

def test_p99_of_the_window_and_its_bound():
    w = LatencyWindow(size=100)
    for i in range(1, 101):
        w.observe(i / 100)
    assert w.p99() == pytest.approx(1.0)
    for _ in range(100):  # the window forgets: only the last 100 count
        w.observe(0.01)
    assert w.p99() == pytest.approx(0.01)


def test_adaptive_deadline_initial_then_multiple_of_p99_with_a_floor():
    assert adaptive_deadline(None, 0, 5, 1.0, 30.0, 20) == 30.0
    assert adaptive_deadline(0.5, 19, 5, 1.0, 30.0, 20) == 30.0  # too few samples yet
    assert adaptive_deadline(0.5, 20, 5, 1.0, 30.0, 20) == 2.5
    assert adaptive_deadline(0.01, 20, 5, 1.0, 30.0, 20) == 1.0  # never under the floor


def test_deadlines_follow_each_stage_and_kind_apart_and_flags_win():
    policy = StallPolicy(fixed={("decode", "inter_token"): 0.75}, multiple=4.0,
                         floor_s={"first_token": 0.1, "inter_token": 0.1},
                         initial_s={"first_token": 30.0, "inter_token": 10.0}, min_samples=5)
    d = StallDeadlines(policy)
    assert d.deadline("prefill", "first_token") == 30.0
    for _ in range(5):
        d.observe("prefill", "first_token", 0.2)
        d.observe("decode", "inter_token", 5.0)  # ignored: the flag's value is used
    assert d.deadline("prefill", "first_token") == pytest.approx(0.8)
    assert d.deadline("decode", "first_token") == 30.0  # nothing observed there
    assert d.deadline("decode", "inter_token") == 0.75


def test_flags_and_env_reach_the_policy(monkeypatch):
    from click.testing import CliRunner

    from agentserving.core.cli import main
    from agentserving.proxy.cli import command

    captured = {}
    monkeypatch.setattr("agentserving.proxy.cli.serve",
                        lambda _factory, settings: captured.setdefault("s", settings))
    result = CliRunner().invoke(main, ["proxy", "--stall-decode-first-token", "3",
                                       "--stall-multiple", "8", "--max-model-len", "2048"],
                                env={"AGENTSERVING_PROXY_STALL_PREFILL_INTER_TOKEN_S": "0.5"})
    assert result.exit_code == 0, result.output
    s: ProxySettings = captured["s"]
    assert s.max_model_len == 2048 and s.stall_detection
    policy = policy_from(s)
    assert policy.fixed[("decode", "first_token")] == 3.0
    assert policy.fixed[("prefill", "inter_token")] == 0.5
    assert policy.fixed[("prefill", "first_token")] is None and policy.multiple == 8.0
    help_text = CliRunner().invoke(command, ["--help"]).output
    for flag in ("--stall-prefill-first-token", "--stall-decode-inter-token",
                 "--stall-first-token-floor", "--no-stall-detection", "--max-model-len",
                 "--probe-interval"):
        assert flag in help_text
    assert settings_from_params({"max_model_len": None}).max_model_len is None


# ------------------------------------------------------------------ deadlines on real sockets

def _pod_server(answers_probes: bool, first_token_after_s: float | None,
                then_silent: bool = False, tokens: int = 3, gap_s: float = 0.0):
    """A pod on a raw socket: ``GET /v1/models`` answered at once when ``answers_probes`` (a
    busy pod's API process) or never (a stopped one); a completion's first token after
    ``first_token_after_s`` (None: never), then ``tokens - 1`` more ``gap_s`` apart (or
    nothing more when ``then_silent``)."""
    import asyncio

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if head.startswith(b"GET /v1/models"):
            if not answers_probes:
                await asyncio.sleep(30)
            body = b'{"data": []}'
            writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: %d\r\n"
                         b"\r\n%s" % (len(body), body))
            await writer.drain()
            writer.close()
            return
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        await reader.readexactly(length)
        if first_token_after_s is None:
            await asyncio.sleep(30)
        await asyncio.sleep(first_token_after_s)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        for i in range(1 if then_silent else tokens):
            if i:
                await asyncio.sleep(gap_s)
            event = b'data: {"choices": [{"text": "a"}]}\n\n'
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
        if then_silent:
            await asyncio.sleep(30)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    return handle


async def _serve(handler):  # type: ignore[no-untyped-def]
    import asyncio

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def test_a_stopped_pod_is_stalled_a_busy_one_is_waited_for_at_any_speed():
    """Real HTTP on loopback. Deadlines of 0.3 s, far shorter than the busy pod's 1.2 s first
    token and 0.8 s gaps: the busy pod answers its probes, so neither its stream nor its
    blocking answer is cut; the stopped pod answers no probe and is stalled, blocking or
    streaming, first token or mid-stream."""
    import asyncio
    import time

    import aiohttp

    from agentserving.proxy.liveness import PodLiveness, http_probe
    from agentserving.proxy.upstream import (
        InterTokenStall,
        Stalled,
        open_watched_stream,
        post_watched,
    )

    async def go() -> None:
        stopped, stopped_url = await _serve(_pod_server(False, None))
        busy, busy_url = await _serve(_pod_server(True, 1.2, tokens=3, gap_s=0.8))
        halted, halted_url = await _serve(_pod_server(False, 0.05, then_silent=True))
        probes: list[str] = []
        gaps: list[float] = []
        async with aiohttp.ClientSession() as http:
            async def probe(url: str) -> bool:
                probes.append(url)
                return await http_probe(http, url, 0.3)

            liveness = PodLiveness(probe, fresh_s=0.05)

            def alive(url: str):  # type: ignore[no-untyped-def]
                return lambda: liveness.answers(url)

            t0 = time.perf_counter()
            with pytest.raises(Stalled) as first:
                await open_watched_stream(http, "p", stopped_url + "/v1/completions", {}, None,
                                          0.3, 0.3, alive=alive(stopped_url))
            assert first.value.kind == "first_token" and first.value.pod == "p"
            with pytest.raises(Stalled):  # blocking, no max_tokens: its silence moves it
                await post_watched(http, "p", stopped_url + "/v1/completions", {}, None, 0.3,
                                   alive(stopped_url))
            assert time.perf_counter() - t0 < 3.0  # two deadlines and two probe timeouts
            assert probes.count(stopped_url) == 2

            reply = await open_watched_stream(http, "b", busy_url + "/v1/completions", {},
                                              None, 0.3, 0.3, on_gap=gaps.append,
                                              alive=alive(busy_url))
            assert reply.first_token_s is not None and reply.first_token_s >= 1.2
            lines = [line async for line in reply.aiter_lines() if line.startswith("data:")]
            assert len(lines) == 3 and len(gaps) == 2 and min(gaps) >= 0.7
            await reply.aclose()
            blocking = await post_watched(http, "b", busy_url + "/v1/completions", {}, None,
                                          0.3, alive(busy_url))
            assert blocking.is_success and blocking.content.count(b"data:") == 3
            assert probes.count(busy_url) >= 4  # asked each time it was silent, and answered

            reply = await open_watched_stream(http, "h", halted_url + "/v1/completions", {},
                                              None, 2.0, 0.3, alive=alive(halted_url))
            seen = []
            with pytest.raises(InterTokenStall) as later:
                async for line in reply.aiter_lines():
                    seen.append(line)
            assert later.value.pod == "h" and seen[0].startswith("data:")
            reply.abort()
            # without a way to ask the pod, silence alone decides (as with no liveness at all)
            with pytest.raises(Stalled):
                await post_watched(http, "b", busy_url + "/v1/completions", {}, None, 0.3, None)
        for server in (stopped, busy, halted):
            server.close()

    asyncio.run(go())


def test_pod_liveness_shares_one_probe_per_pod_and_trusts_an_answer_briefly():
    import asyncio

    from agentserving.proxy.liveness import PodLiveness

    calls: list[str] = []
    now = [0.0]
    answers = {"a": True, "b": False}

    async def probe(url: str) -> bool:
        calls.append(url)
        await asyncio.sleep(0.05)
        return answers[url]

    async def go() -> None:
        live = PodLiveness(probe, fresh_s=1.0, clock=lambda: now[0])
        assert await asyncio.gather(*(live.answers("a") for _ in range(5))) == [True] * 5
        assert calls == ["a"]  # five silent turns, one probe
        now[0] = 0.5
        assert await live.answers("a") and calls == ["a"]  # still fresh
        now[0] = 1.6
        answers["a"] = False  # stopped since
        assert not await live.answers("a") and calls == ["a", "a"]
        assert not await live.answers("a") and calls == ["a", "a", "a"]  # silence is not kept
        assert not any(await asyncio.gather(live.answers("b"), live.answers("b")))
        assert calls.count("b") == 1

    asyncio.run(go())
