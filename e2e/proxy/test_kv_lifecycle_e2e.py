"""The KV lifecycle on a fleet of real processes (kvindex, one reference worker with DRAM and
disk tiers, the proxy), driven through the official `openai` SDK: every session exists from
its first turn, `cache_control` and Dynamo's `nvext` hints (through `extra_body`) become the
session's pin and priority, a compaction evicts the context it dropped from the pod's tiers
while a fork's references keep theirs, and a final turn's close reclaims the session's whole
context; the frees are counted on the kvindex's /metrics."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from testkit.servers import wait_until as wait_for

CHUNK = 256  # the fleet workers' --chunk-size


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 30000 + 10 for i in range(n)]


SYSTEM = tokens(90, 2 * CHUNK)  # two chunks every session of the agent starts with


@pytest.fixture(scope="module")
def fleet(fleet_factory):
    f = fleet_factory
    f.start_kvindex()
    f.start_worker("w0")
    f.proxy = f.start_proxy("--prefill", f.workers["w0"].url)
    return f


def sdk(fleet) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=fleet.proxy.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def turn(fleet, session: str, prompt: list[int], headers: dict | None = None,  # type: ignore[no-untyped-def]
         **extra: object) -> list[str]:
    """One turn; the chunk hashes the worker named for its prompt."""
    resp = sdk(fleet).completions.create(
        model="tiny", prompt=prompt, max_tokens=2,
        extra_headers={"x-session-id": session, **(headers or {})},
        extra_body={"forced_output_token_ids": [100, 101], **extra})
    return (resp.model_extra or {})["kv_transfer_params"]["chunk_hashes"]


def kv(fleet, method: str, path: str) -> httpx.Response:  # type: ignore[no-untyped-def]
    return httpx.request(method, fleet.kvindex.url + path, headers=fleet.headers, timeout=5)


def on_pod(fleet) -> set[str]:  # type: ignore[no-untyped-def]
    """Every chunk w0's tiers hold, by the pod's own listing."""
    held = httpx.get(fleet.workers["w0"].memory_url + "/memory/chunks", headers=fleet.headers,
                     timeout=5).json()["chunks"]
    return {c for chunks in held.values() for c in chunks}


def indexed(fleet, chunks: list[str]) -> bool:  # type: ignore[no-untyped-def]
    """The kvindex knows w0 holds every one of ``chunks`` (what its fan-out acts on)."""
    return all(kv(fleet, "GET", f"/v1/chunks/{c}").json()["locations"] for c in chunks)


def reclaimed(fleet, reason: str) -> float:  # type: ignore[no-untyped-def]
    text = kv(fleet, "GET", "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvindex_reclaimed_chunks_total{")
               and f'reason="{reason}"' in line)


def test_cache_control_and_agent_hints_through_extra_body_become_the_sessions_pin(fleet):
    chunks = turn(fleet, "hinted", SYSTEM + tokens(1, CHUNK),
                  nvext={"cache_control": {"type": "ephemeral", "ttl": "5m"},
                         "agent_hints": {"priority": 6, "osl": 2, "speculative_prefill": False}})
    info = wait_for(lambda: (r := kv(fleet, "GET", "/v1/sessions/hinted")).status_code == 200
                    and r.json()["pinned_until"] and r.json(), what="the session pinned")
    assert info["pinned_until"] == pytest.approx(time.time() + 300, abs=30)
    assert info["priority"] == 6 and info["intents"] == {"~context": chunks}

    # Anthropic's spelling, at the top of the body; the worker took vllm_xargs and answered
    turn(fleet, "anthropic", SYSTEM + tokens(2, CHUNK),
         cache_control={"type": "ephemeral", "ttl": "1h"})
    info = wait_for(lambda: (r := kv(fleet, "GET", "/v1/sessions/anthropic")).status_code == 200
                    and r.json()["pinned_until"] and r.json(), what="the session pinned")
    assert info["pinned_until"] == pytest.approx(time.time() + 3600, abs=30)

    with pytest.raises(openai.BadRequestError) as bad:
        turn(fleet, "typo", SYSTEM, cache_control={"type": "ephemeral", "ttl": "5 minutes"})
    assert bad.value.body["param"] == "cache_control.ttl"  # type: ignore[index]


def test_a_compaction_evicts_the_dropped_context_but_a_fork_keeps_its_share(fleet):
    solo_old = turn(fleet, "solo", SYSTEM + tokens(3, 3 * CHUNK))
    forked_old = turn(fleet, "forked", SYSTEM + tokens(4, 3 * CHUNK))
    # a branch of "forked" (its first turn extends the parent's context)
    turn(fleet, "branch", SYSTEM + tokens(4, 3 * CHUNK) + tokens(5, CHUNK),
         headers={"x-parent-session-id": "forked"})
    wait_for(lambda: indexed(fleet, solo_old + forked_old), what="the contexts indexed")
    assert set(solo_old + forked_old) <= on_pod(fleet)
    before = reclaimed(fleet, "context_change")

    # both agents compact their history: the new prompt shares only the system prompt
    solo_new = turn(fleet, "solo", SYSTEM + tokens(6, CHUNK))
    forked_new = turn(fleet, "forked", SYSTEM + tokens(7, CHUNK))
    assert solo_new[:2] == solo_old[:2] and forked_new[:2] == forked_old[:2]
    dropped = set(solo_old[2:])
    wait_for(lambda: not dropped & on_pod(fleet), what="the dropped context evicted")
    held = on_pod(fleet)
    assert set(forked_old) <= held  # the branch still references the parent's old context
    assert set(solo_old[:2]) <= held and set(solo_new) <= held  # the shared system prompt
    assert reclaimed(fleet, "context_change") >= before + len(dropped)
    metrics = httpx.get(fleet.proxy.url + "/metrics", timeout=5).text
    assert "proxy_context_changes_total 2.0" in metrics


def test_a_final_turn_reclaims_a_session_that_never_wrote_an_intent(fleet):
    first = turn(fleet, "short-lived", tokens(8, 3 * CHUNK))
    wait_for(lambda: indexed(fleet, first), what="its chunks indexed")
    before = reclaimed(fleet, "close")
    last = turn(fleet, "short-lived", tokens(8, 3 * CHUNK) + tokens(9, CHUNK),
                agent_memory={"close_session": True})
    wait_for(lambda: kv(fleet, "GET", "/v1/sessions/short-lived").status_code == 404,
             what="the session closed")
    # its first turn's chunks were indexed when it closed: they left every tier of the pod
    wait_for(lambda: not set(first) & on_pod(fleet), what="its context reclaimed")
    assert reclaimed(fleet, "close") >= before + len(first)
    assert len(last) == 4
