"""The shared vLLM fleet, left as each test found it: nothing pinned, cached or running.

A test on the shared fleet pins KV (vLLM's device blocks, LMCache's chunks), fills the pods'
tiers and their KV servers, or is cut off by its timeout mid-request. Whatever it leaves changes
the numbers of the tests after it: a pinned block makes vLLM refuse ``/reset_prefix_cache``, and
a later test that expects its prompt back from LMCache's tiers gets it from vLLM's own cache
instead. So after every test, passed or failed, ``reset`` takes every pod back to cold (pins
released, every tier and KV server emptied, no request in flight, vLLM's prefix cache reset and
the reset checked, the kvindex listing nothing) and returns what it could not clear; the
fixture in conftest.py fails that test's teardown naming it, and every later test at its start,
instead of letting one of them fail with a wrong number.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from agentserving.engine.memory_api import engine_process_url
from agentserving.engine.vllm.prefix_cache import PrefixCacheBusy, reset_prefix_cache

POD_ROLES = ("prefill", "decode", "both")
BATCH = 512  # chunk hashes per memory-API call
LISTING = 1000  # a KV server's listing page


def metric_sum(text: str, name: str) -> float:
    """Every sample of ``name`` in a Prometheus text exposition, summed (0 when absent)."""
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples if s.name == name)


def _batches(items: list[str]) -> Iterable[list[str]]:
    return (items[i:i + BATCH] for i in range(0, len(items), BATCH))


class FleetView:
    """What a test can leave behind on a fleet: its vLLM pods, their KV servers, the kvindex."""

    def __init__(self, procs: Iterable[Any], kvindex: str) -> None:
        specs = [mp.spec for mp in procs]
        self.pods = {s.name: (s.url, s.memory_url) for s in specs
                     if s.role in POD_ROLES and s.url and s.memory_url}
        self.kv_servers = {s.name: s.url for s in specs if s.role == "kvserver" and s.url}
        self.kvindex = kvindex

    # ------------------------------------------------------------------ reading
    def pod_chunks(self, client: httpx.Client, pod: str) -> dict[str, list[str]]:
        """Every chunk the pod holds, by tier (vLLM's own cache as tier ``device``)."""
        return client.get(self.pods[pod][1] + "/memory/chunks").json()["chunks"]

    def server_chunks(self, client: httpx.Client, server: str) -> list[str]:
        out: list[str] = []
        while True:
            page = client.get(self.kv_servers[server] + "/v1/chunks",
                              params={"offset": len(out), "limit": LISTING}).json()
            out += [c["chunk_hash"] for c in page["chunks"]]
            if not page["chunks"] or len(out) >= page["total_chunks"]:
                return out

    def in_flight(self, client: httpx.Client, pod: str) -> int:
        text = client.get(self.pods[pod][0] + "/metrics").text
        return int(metric_sum(text, "vllm:num_requests_running")
                   + metric_sum(text, "vllm:num_requests_waiting"))

    def leftovers(self, client: httpx.Client) -> list[str]:
        """What the fleet holds that a cold one does not, one line each ([] when clean)."""
        left = []
        for pod, (_, memory) in self.pods.items():
            if n := self.in_flight(client, pod):
                left.append(f"{pod}: {n} requests running or waiting")
            device = metric_sum(client.get(memory + "/metrics").text,
                                "agentserving_vllm_device_pinned_blocks")
            if device:
                left.append(f"{pod}: {device:.0f} device blocks pinned")
            lmcache = metric_sum(client.get(engine_process_url(memory) + "/metrics").text,
                                 "agentserving_kv_pinned_chunks")
            if lmcache:
                left.append(f"{pod}: {lmcache:.0f} LMCache chunks pinned")
            held = {tier: len(v) for tier, v in self.pod_chunks(client, pod).items() if v}
            if held:
                left.append(f"{pod}: chunks in its tiers {held}")
        for server in self.kv_servers:
            if held_n := len(self.server_chunks(client, server)):
                left.append(f"{server}: {held_n} chunks")
        for pod in client.get(self.kvindex + "/v1/pods").json()["pods"]:
            listed = {t: n for t, n in (pod.get("chunks") or {}).items() if n}
            if pod["pod"] in self.pods and listed:
                left.append(f"kvindex: still lists {listed} on {pod['pod']}")
        return left

    # ------------------------------------------------------------------ acting
    def _empty_tiers(self, client: httpx.Client) -> None:
        """Release every pin and evict every chunk (device cache and KV server included)."""
        for pod, (_, memory) in self.pods.items():
            chunks = sorted({h for v in self.pod_chunks(client, pod).values() for h in v})
            for batch in _batches(chunks):
                client.post(memory + "/memory/unpin", json={"chunk_hashes": batch})
                client.post(memory + "/memory/evict", json={"chunk_hashes": batch})
        for server, url in self.kv_servers.items():
            for batch in _batches(self.server_chunks(client, server)):
                client.post(url + "/memory/evict", json={"chunk_hashes": batch})

    def _step(self, client: httpx.Client) -> None:
        """One step per pod: vLLM's scheduler applies the queued releases there. One token,
        no full block: nothing new is cached."""
        for url, _ in self.pods.values():
            model = client.get(url + "/v1/models").json()["data"][0]["id"]
            client.post(url + "/v1/completions",
                        json={"model": model, "prompt": [1], "max_tokens": 1})

    def reset(self, bound_s: float) -> list[str]:
        """Every pod back to cold within ``bound_s``; returns what is left ([]: clean)."""
        deadline = time.monotonic() + bound_s
        with httpx.Client(timeout=max(10.0, bound_s)) as client:
            while any(self.in_flight(client, pod) for pod in self.pods):
                if time.monotonic() > deadline:
                    return self.leftovers(client)
                time.sleep(0.2)
            left: list[str] = []
            while True:
                self._empty_tiers(client)
                self._step(client)
                busy = []
                for pod, (url, _) in self.pods.items():
                    try:
                        reset_prefix_cache(url, max(1.0, deadline - time.monotonic()), client)
                    except PrefixCacheBusy as e:
                        busy.append(f"{pod}: {e}")
                left = busy + self.leftovers(client)
                # a disk write or residency report still in flight clears on the next round
                if not left or time.monotonic() > deadline:
                    return left
                time.sleep(0.25)
