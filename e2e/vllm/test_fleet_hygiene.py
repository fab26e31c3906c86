"""The shared fleet's reset (``fleet_hygiene``), through the same calls the fixture makes: a test
that leaves a device pin, LMCache pins, chunks in every tier, a P/D hand-off in the prefill
pod's KV server and vLLM's prefix cache full is seen leaving each of them, and one reset takes
the fleet back to cold: nothing pinned, listed or cached, and vLLM's own reset accepted."""

from __future__ import annotations

import httpx
import pytest

from agentserving.engine.vllm.prefix_cache import reset_refused

from .conftest import RESET_BOUND_S, VllmFleet, bound, post, vllm_metrics
from .test_vllm_fleet import completion, delta, prompt_ids

# the first test of the package also waits for the shared fleet to start
pytestmark = pytest.mark.timeout(900)


def test_a_reset_clears_what_a_test_leaves_and_says_what_it_found(vllm_fleet: VllmFleet) -> None:
    worker, mem = vllm_fleet.url("worker-0"), vllm_fleet.memory_url("worker-0")
    prompt = prompt_ids(91, 1500)
    pinned = completion(worker, prompt, vllm_xargs={"agentserving_pin_ttl_s": 600})
    chunks = pinned["kv_transfer_params"]["chunk_hashes"]
    assert post(mem, "/memory/pin", {"chunk_hashes": chunks, "ttl_s": 600})["num_pinned"] > 0
    r = httpx.post(vllm_fleet.proxy + "/v1/completions", timeout=bound(120),
                   headers={"x-session-id": "left-behind"},
                   json={"model": "tiny", "prompt": prompt_ids(92, 2600), "max_tokens": 2})
    assert r.headers["x-agentserving-pd"] == "disaggregated", r.text

    with httpx.Client(timeout=bound(30)) as client:
        found = "\n".join(vllm_fleet.view.leftovers(client))
        # vLLM refuses to drop a cache a pin holds blocks of (200, success false)
        assert reset_refused(client.post(worker + "/reset_prefix_cache"))
    for left in ("worker-0: 10 device blocks pinned", "worker-0: 5 LMCache chunks pinned",
                 "worker-0: chunks in its tiers", "kvserver-prefill-0: ", "prefill-0: chunks"):
        assert left in found, (left, found)

    assert vllm_fleet.view.reset(bound(RESET_BOUND_S)) == []
    with httpx.Client(timeout=bound(30)) as client:
        assert vllm_fleet.view.leftovers(client) == []
    # cold for real: the pinned prompt again is computed, from no tier and no cached block
    before = vllm_metrics(worker)
    again = completion(worker, prompt)
    after = vllm_metrics(worker)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert delta(before, after, "local_compute") == len(prompt)
