"""vLLM's device prefix cache as a tier the lifecycle verbs reach (``engine.vllm.device_kv``), on
the shared vLLM fleet's ``worker-0``: a turn asking for a pin (``vllm_xargs``) keeps its blocks
through a flood of other prompts that takes every unpinned block, so its next turn hits vLLM's
own cache where an unpinned one of the same age falls back to LMCache; the kvindex sees the
pinned context in tier device (alone, once LMCache's tiers dropped it); an unpin gives the
blocks back and an evict of every tier takes the chunks out of the device cache too.

The flood is sized from the pool the pod reports (``vllm:cache_config_info``), not a count of
long prompts: worker-0's 80 blocks take five 2,048-token prompts, on any machine."""

from __future__ import annotations

import math
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agentserving.engine.memory_api import engine_process_url

from .conftest import VllmFleet, post, vllm_metrics, wait_until
from .fleet_hygiene import metric_sum
from .test_vllm_fleet import completion, delta, prompt_ids

# the first test of the package also waits for the shared fleet to start
pytestmark = pytest.mark.timeout(900)

POD = "worker-0"
LOCAL = "local_cache_hit"
PROMPT = 1500  # 5 full 256-token chunks
FLOOD_PROMPT = 2048  # tokens per flood prompt: one prefill step each


def _device_chunks(fleet: VllmFleet, hashes: list[str]) -> int:
    found = 0
    for h in hashes:
        locs = httpx.get(f"{fleet.kvindex}/v1/chunks/{h}", timeout=5).json()["locations"]
        found += {"pod": POD, "tier": "device"} in locs
    return found


def _pool(fleet: VllmFleet) -> tuple[int, int]:
    """The pod's device pool as vLLM reports it: (blocks, tokens per block)."""
    text = httpx.get(fleet.url(POD) + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:cache_config_info":
                return int(sample.labels["num_gpu_blocks"]), int(sample.labels["block_size"])
    raise AssertionError("vllm:cache_config_info not in the pod's metrics")


def _scheduler_metric(fleet: VllmFleet, name: str) -> float:
    for line in httpx.get(fleet.memory_url(POD) + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_pinned_turn_keeps_its_device_blocks_through_a_flood(vllm_fleet: VllmFleet) -> None:
    url = vllm_fleet.url(POD)
    kept, lost = prompt_ids(701, PROMPT), prompt_ids(702, PROMPT)
    a = completion(url, kept, vllm_xargs={"agentserving_pin_ttl_s": 600})
    b = completion(url, lost)
    kept_chunks = a["kv_transfer_params"]["chunk_hashes"][:5]
    lost_chunks = b["kv_transfer_params"]["chunk_hashes"][:5]
    # the kvindex sees both contexts in vLLM's own cache
    wait_until("both contexts reported in tier device",
               lambda: _device_chunks(vllm_fleet, kept_chunks + lost_chunks) == 10)
    assert _scheduler_metric(vllm_fleet, "agentserving_vllm_device_pinned_blocks") > 0
    # the pod's LMCache tiers take pins by chunk (what the kvindex's pin fans out)
    mem = vllm_fleet.memory_url(POD)
    pinned = post(mem, "/memory/pin", {"chunk_hashes": lost_chunks, "ttl_s": 60})
    assert pinned["num_pinned"] == 5 and pinned["num_refused"] == 0, pinned
    assert post(mem, "/memory/unpin", {"chunk_hashes": lost_chunks})["num_unpinned"] == 5
    # out of LMCache's DRAM and disk, the context is in vLLM's prefix cache alone, and the
    # kvindex says so
    post(vllm_fleet.memory_url(POD), "/memory/evict",
         {"chunk_hashes": kept_chunks, "locations": ["cpu", "disk"]})
    wait_until("the kept context in tier device only", lambda: all(
        httpx.get(f"{vllm_fleet.kvindex}/v1/chunks/{h}", timeout=5).json()["locations"]
        == [{"pod": POD, "tier": "device"}] for h in kept_chunks))

    # a flood of other prompts until the unpinned context has left the device cache: every
    # block of the pool once over, and one prompt more
    blocks, block_tokens = _pool(vllm_fleet)
    flood = math.ceil(blocks * block_tokens / FLOOD_PROMPT) + 1
    for seed in range(710, 710 + flood):
        completion(url, prompt_ids(seed, FLOOD_PROMPT), max_tokens=1)
        time.sleep(0.6)  # a residency report
        if _device_chunks(vllm_fleet, lost_chunks) == 0:
            break
    else:
        raise AssertionError(f"{flood} prompts of {FLOOD_PROMPT} tokens, {blocks} blocks of "
                             f"{block_tokens} once over, never took the unpinned context's "
                             "blocks")
    assert _device_chunks(vllm_fleet, kept_chunks) == 5

    tail = prompt_ids(703, 60)[1:]
    before = vllm_metrics(url)
    completion(url, kept + tail)
    assert delta(before, vllm_metrics(url), LOCAL) >= 5 * 256  # from vLLM's own cache
    before = vllm_metrics(url)
    completion(url, lost + tail)
    assert delta(before, vllm_metrics(url), LOCAL) < 5 * 256  # LMCache, or recomputed

    # unpin: the pins go at the next step; evict (every tier): the device cache drops them
    post(vllm_fleet.memory_url(POD), "/memory/unpin", {"chunk_hashes": kept_chunks})
    completion(url, prompt_ids(704, 40), max_tokens=1)  # a step: the release applies
    assert _scheduler_metric(vllm_fleet, "agentserving_vllm_device_pinned_blocks") == 0
    released = 'agentserving_vllm_device_pins_total{outcome="released"}'
    assert _scheduler_metric(vllm_fleet, released) >= 1
    post(vllm_fleet.memory_url(POD), "/memory/evict", {"chunk_hashes": kept_chunks})
    completion(url, prompt_ids(705, 40), max_tokens=1)
    wait_until("the evicted context gone from tier device",
               lambda: _device_chunks(vllm_fleet, kept_chunks) == 0)
    before = vllm_metrics(url)
    completion(url, kept + tail)
    assert delta(before, vllm_metrics(url), LOCAL) == 0


def _rank_pinned(fleet: VllmFleet) -> float:
    """The chunks worker-0's first engine rank holds pinned in its LMCache tiers."""
    text = httpx.get(engine_process_url(fleet.memory_url(POD)) + "/metrics", timeout=10).text
    return metric_sum(text, "agentserving_kv_pinned_chunks")


def test_an_announce_hold_pins_the_turns_kv_and_its_dram_copies_once_read(
        vllm_fleet: VllmFleet) -> None:
    # a turn announced with a hold (the proxy's --announce-hold), its context partly on disk
    # only: the pod pins every chunk at once and, once the announce's read has brought the
    # disk-only ones into DRAM, their DRAM copies too: losing the disk copies leaves all five
    # held. (A hold on the disk copies alone would be forgotten with them.)
    mem = vllm_fleet.memory_url(POD)
    done = completion(vllm_fleet.url(POD), prompt_ids(720, PROMPT))
    chunks = done["kv_transfer_params"]["chunk_hashes"][:5]

    def where(tier: str) -> set[str]:
        return set(httpx.get(mem + "/memory/chunks", timeout=10).json()["chunks"].get(tier, []))

    wait_until("the context on disk", lambda: set(chunks) <= where("disk"))
    post(mem, "/memory/evict", {"chunk_hashes": chunks[:2], "locations": ["cpu"]})
    assert not set(chunks[:2]) & where("cpu")
    held = post(mem, "/memory/prefetch", {"chunk_hashes": chunks, "lookup_id": "tool-gap:hold",
                                          "expected_in_s": 0.5, "hold_s": 120})
    assert held["num_held"] == 5, held
    wait_until("the announce's read in DRAM", lambda: set(chunks) <= where("cpu"))
    wait_until("the DRAM copies held too", lambda: (
        post(mem, "/memory/evict", {"chunk_hashes": chunks, "locations": ["disk"]})
        and _rank_pinned(vllm_fleet) == 5 and not set(chunks) & where("disk")))
    assert post(mem, "/memory/unpin", {"chunk_hashes": chunks})["num_unpinned"] == 5
    assert _rank_pinned(vllm_fleet) == 0
