"""Fuzz the proxy from its own OpenAPI, in front of a real fleet: a kvindex, a tiny reference
worker found through it, the proxy's memory hooks writing sessions to the kvindex.

The proxy passes a turn's body on to a worker, which validates it; the proxy's schema (the
workers' request models plus ``agent_memory``) cannot know the model's vocabulary or context,
so a 400 with code ``token_id_out_of_vocabulary`` or ``context_length_exceeded`` is the one
answer a schema-valid turn may get (st_hooks.py), besides ``empty_conversation``: a Responses
request whose input holds only reasoning items and continues nothing. After the run: every
process is alive, a greedy turn through the proxy still gives the worker's own tokens, and the
sessions the memory hooks wrote read back as chunk hashes.
"""

from __future__ import annotations

import urllib.parse

import httpx

from agentserving.core.hashing import is_chunk_hash
from testkit.worker import prompt

SESSION = "fuzz-agent-session"


def _greedy(url: str) -> list[int]:
    r = httpx.post(url + "/v1/completions", json={
        "prompt": prompt(16, seed=11), "max_tokens": 8, "temperature": 0.0,
        "return_token_ids": True}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_proxy_fuzz(fleet, fuzz) -> None:  # type: ignore[no-untyped-def]
    direct = _greedy(fleet.worker.url)
    assert _greedy(fleet.proxy_url) == direct
    # every turn in one agent session: session state, routing by its last chunk hashes and
    # the memory hooks (agent_memory) are exercised along with the body's validation
    run = fuzz(fleet.proxy_url, "proxy", max_examples=10, timeout_s=300,
               extra=("-H", f"x-session-id: {SESSION}"),
               runtime_limit_codes=("context_length_exceeded", "token_id_out_of_vocabulary",
                                   "empty_conversation",
                                   "integer_out_of_range"))
    run.assert_clean()
    assert _greedy(fleet.proxy_url) == direct, "a greedy turn through the proxy changed"
    pods = httpx.get(fleet.kvindex_url + "/v1/pods", timeout=10).json()["pods"]
    assert [p["pod"] for p in pods] == ["fuzz-worker"], pods
    r = httpx.get(f"{fleet.kvindex_url}/v1/sessions/{SESSION}", timeout=10)
    intents = r.json()["intents"] if r.status_code == 200 else {}
    assert r.status_code in (200, 404), r.text
    for intent, chunks in intents.items():
        assert all(is_chunk_hash(h) for h in chunks), (intent, chunks)
        got = httpx.get(f"{fleet.kvindex_url}/v1/sessions/{SESSION}/intents/"
                        f"{urllib.parse.quote(intent, safe='')}", timeout=10)
        assert "/" in intent or got.json()["chunk_hashes"] == chunks, (intent, got.text)
    print(f"[fuzz] after the run: the session's {len(intents)} intents read back")
