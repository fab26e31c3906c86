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

def test_a_silent_pod_misses_its_first_token_and_a_stream_that_stops_its_next_one():
    """Real HTTP on loopback: a server that takes the request and never answers (a stopped
    process), and one that sends a first token then goes silent."""
    import asyncio
    import time

    import aiohttp

    from agentserving.proxy.upstream import (
        InterTokenStall,
        Stalled,
        open_watched_stream,
        post_watched,
    )

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await asyncio.sleep(30)

    async def one_token(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        event = b'data: {"choices": [{"text": "a"}]}\n\n'
        writer.write(b"%x\r\n%s\r\n" % (len(event), event))
        await writer.drain()
        await asyncio.sleep(30)

    async def go() -> None:
        servers = [await asyncio.start_server(h, "127.0.0.1", 0) for h in (silent, one_token)]
        hang, stop = (f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}/v1/completions"
                      for s in servers)
        gaps: list[float] = []
        async with aiohttp.ClientSession() as http:
            t0 = time.perf_counter()
            with pytest.raises(Stalled) as first:
                await open_watched_stream(http, "p", hang, {}, None, 0.3, 0.3)
            assert first.value.kind == "first_token" and first.value.pod == "p"
            with pytest.raises(Stalled):
                await post_watched(http, "p", hang, {}, None, 0.3)
            assert time.perf_counter() - t0 < 2.0
            reply = await open_watched_stream(http, "q", stop, {}, None, 2.0, 0.3,
                                              on_gap=gaps.append)
            assert reply.first_token_s is not None and reply.first_token_s < 2.0
            lines = []
            with pytest.raises(InterTokenStall) as later:
                async for line in reply.aiter_lines():
                    lines.append(line)
            assert later.value.pod == "q" and lines[0].startswith("data:")
            reply.abort()
        for s in servers:
            s.close()

    asyncio.run(go())
