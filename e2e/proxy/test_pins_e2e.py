"""Pins that hold in the pod's own tiers, on a real fleet (kvindex, one reference worker with
about 10 chunks of DRAM and no disk, the proxy): a session pinned after its turn keeps its
whole context through a flood of other sessions that overflows LMCache's DRAM tier, where a
session of the same age left unpinned loses it; released, the pinned one is evictable again."""

from __future__ import annotations

import httpx
import pytest

from .test_proxy_e2e import chunk_hashes_of, client, prompt_for, turn, wait_for

PROMPT = 800  # 3 full 256-token chunks


@pytest.fixture(scope="module")
def small_fleet(fleet_factory):
    f = fleet_factory
    f.start_kvindex()
    f.start_worker("small", disk=False, cpu_gib=0.02)
    f.proxy = f.start_proxy()
    wait_for(lambda: httpx.get(f.kvindex.url + "/v1/pods", headers=f.headers,
                               timeout=5).json()["pods"], what="the pod registered")
    return f


def _in_dram(fleet, chunks: list[str]) -> int:
    held = httpx.get(fleet.workers["small"].memory_url + "/memory/chunks", headers=fleet.headers,
                     timeout=5).json()["chunks"].get("cpu", [])
    return len(set(chunks) & set(held))


def test_a_pinned_sessions_context_outlives_a_flood_of_other_sessions(small_fleet):
    f, c = small_fleet, client(small_fleet.proxy)
    kept_prompt, lost_prompt = prompt_for(1, PROMPT), prompt_for(2, PROMPT)
    kept, _ = turn(c, "kept", kept_prompt,
                   extra={"agent_memory": {"intent": "ctx", "pin_ttl_s": 600}})
    lost, _ = turn(c, "lost", lost_prompt, extra={"agent_memory": {"intent": "ctx"}})
    kept_chunks, lost_chunks = chunk_hashes_of(kept)[:3], chunk_hashes_of(lost)[:3]
    wait_for(lambda: _in_dram(f, kept_chunks) == 3, what="the pinned session's chunks pinned")
    for seed in range(10, 16):  # 18 chunks of other sessions: more than DRAM holds
        turn(c, f"flood-{seed}", prompt_for(seed, PROMPT))
    assert _in_dram(f, kept_chunks) == 3
    assert _in_dram(f, lost_chunks) < 3
    tail = prompt_for(3, 40)
    again, _ = turn(c, "kept", kept_prompt + tail)
    assert again.usage.prompt_tokens_details.cached_tokens == 768
    other, _ = turn(c, "lost", lost_prompt + tail)
    assert other.usage.prompt_tokens_details.cached_tokens < 768
    metrics = httpx.get(f.workers["small"].engine_memory_url + "/metrics", headers=f.headers,
                        timeout=5).text
    assert 'agentserving_kv_pins_total{outcome="pinned"} 3.0' in metrics

    # released: the pod gives its pins back and its LRU takes the chunks like any other
    r = httpx.post(f.kvindex.url + "/v1/sessions/kept/release", headers=f.headers, timeout=5)
    assert r.status_code == 200, r.text
    for seed in range(20, 26):
        turn(c, f"flood-{seed}", prompt_for(seed, PROMPT))
    assert _in_dram(f, kept_chunks) < 3
