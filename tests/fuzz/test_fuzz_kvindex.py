"""Fuzz the kvindex from its own OpenAPI, on the memory backend and on a real redis-server,
then check that what it stores is not corrupted. The fuzzer writes freely (it reuses the names
it reads back, so it also rewrites the state seeded before it runs); what must hold whatever
it did:

- every pod listed reads back the same alone, with non-negative counts;
- the per-pod counts agree with the per-chunk view: over every chunk hash the run ever sent,
  the chunks located on a pod in a tier number exactly what the pod's counts say, and no chunk
  is located on a pod that is not registered (no residency left behind by a deregistration);
- every session the run named reads back the same intent by intent;
- the index still answers a fresh round trip right; and, on Redis, the two views of the key
  layout (per chunk, per pod) and the session reference counts agree key by key.
"""

from __future__ import annotations

import collections
import json
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from agentserving.core.hashing import ChunkHasher, is_chunk_hash
from testkit.servers import AGENTSERVING, free_port, redis_server, service_process

MAX_EXAMPLES = 40
CHAIN = ChunkHasher(chunk_size=4).hashes(list(range(48)))  # 12 chained hashes
ANCHOR_POD = "fuzz-seed-pod"  # state for the fuzzer to find (it reads names back)
ANCHOR_SESSION = "fuzz-seed-session"


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with redis_server() as server:
        yield server.url


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def kvindex(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str]]:
    store = "memory" if request.param == "memory" else request.getfixturevalue("redis_url")
    if store != "memory":
        redis.Redis.from_url(store).flushdb()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # leases outlive the run: the anchor pod must not be reaped while the fuzzer works
    with service_process([AGENTSERVING, "kvindex", "--port", str(port), "--store", store,
                          "--lease-ttl", "3600", "--max-batch-chunks", "4096",
                          "--fanout-timeout", "0.2", "--log-level", "warning"],
                         url + "/readyz", log_path=tmp_path / "kvindex.log") as proc:
        yield url, store
        assert proc.poll() is None, "the kvindex died during the fuzz run"


def _ok(r: httpx.Response) -> dict:
    assert r.is_success, f"{r.request.method} {r.request.url}: {r.status_code} {r.text}"
    return r.json() if r.content else {}


def _seed(c: httpx.Client) -> None:
    _ok(c.post("/v1/pods", json={"pod": ANCHOR_POD, "memory_api_url": "http://127.0.0.1:9",
                                 "model": "tiny", "chunk_size": 4, "role": "both"}))
    _ok(c.post("/v1/events", json={"pod": ANCHOR_POD, "seq": 1, "events": [
        {"op": "stored", "tier": "cpu", "chunk_hashes": CHAIN[:8], "bytes": 8000},
        {"op": "stored", "tier": "disk", "chunk_hashes": CHAIN[:12], "bytes": 12000}]}))
    _ok(c.put(f"/v1/sessions/{ANCHOR_SESSION}/intents/plan",
              json={"chunk_hashes": CHAIN[:6]}))


def _check_pods_consistent(c: httpx.Client) -> dict[str, dict]:
    """Every listed pod reads back the same alone, with non-negative counts."""
    pods = {p["pod"]: p for p in _ok(c.get("/v1/pods"))["pods"]}
    for name, listed in pods.items():
        alone = _ok(c.get("/v1/pods/" + urllib.parse.quote(name, safe="")))
        for key in ("pod", "seq", "chunks", "used_bytes", "memory_api_url", "role"):
            assert alone[key] == listed[key], (key, alone, listed)
        assert all(n >= 0 for n in listed["chunks"].values()), listed
        assert all(n >= 0 for n in listed["used_bytes"].values()), listed
    return pods


def _check_residency_consistent(c: httpx.Client, pods: dict[str, dict],
                                sent: set[str]) -> int:
    """Per-pod counts == what the per-chunk view locates, over every chunk ever sent."""
    located: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    hashes = sorted(h for h in sent | set(CHAIN) if is_chunk_hash(h))
    for h in hashes:
        for loc in _ok(c.get(f"/v1/chunks/{h}"))["locations"]:
            assert loc["pod"] in pods, f"chunk {h} located on unregistered pod {loc['pod']!r}"
            located[loc["pod"]][loc["tier"]] += 1
    for name, info in pods.items():
        counts = {t: n for t, n in info["chunks"].items() if n}
        assert dict(located.get(name, {})) == counts, (name, dict(located.get(name, {})), counts)
    return len(hashes)


def _check_sessions_consistent(c: httpx.Client, sent: set[str]) -> int:
    seen = 0
    for sid in sorted(sent):
        if not sid or "/" in sid:
            continue
        r = c.get("/v1/sessions/" + urllib.parse.quote(sid, safe=""))
        if r.status_code == 404:
            continue
        info = _ok(r)
        seen += 1
        assert info["session_id"] == sid, info
        for intent, chunks in info["intents"].items():
            assert all(is_chunk_hash(h) for h in chunks), (sid, intent, chunks)
            path = (f"/v1/sessions/{urllib.parse.quote(sid, safe='')}/intents/"
                    f"{urllib.parse.quote(intent, safe='')}")
            if intent and "/" not in intent:
                assert _ok(c.get(path))["chunk_hashes"] == chunks, (sid, intent)
    return seen


def _check_round_trip(c: httpx.Client) -> None:
    """The index still does its job for a pod that arrives after the fuzzer."""
    pod = "fuzz-after-pod"
    _ok(c.post("/v1/pods", json={"pod": pod, "memory_api_url": "http://127.0.0.1:9",
                                 "model": "tiny", "chunk_size": 4}))
    _ok(c.post("/v1/events", json={"pod": pod, "seq": 1, "events": [
        {"op": "stored", "tier": "device", "chunk_hashes": CHAIN[:3]}]}))
    got = _ok(c.post("/v1/lookup", json={"chunk_hashes": CHAIN, "pods": [pod]}))
    assert got["best_pod"] == pod and got["pods"][0]["prefix_chunks"] == 3, got
    assert c.delete(f"/v1/pods/{pod}").status_code == 204
    assert all(loc["pod"] != pod for loc in _ok(c.get(f"/v1/chunks/{CHAIN[0]}"))["locations"])


def _check_redis_layout(url: str) -> None:
    """The per-chunk and per-pod views agree, counts match, session references add up."""
    r = redis.Redis.from_url(url)
    p = b"as:"
    pods = {m for m in r.smembers(p + b"pods")}
    slots = {int(k): v for k, v in r.hgetall(p + b"slots").items()}
    assert set(slots.values()) == pods, (slots, pods)
    by_chunk = r.hgetall(p + b"chunks")
    from_pods: dict[bytes, dict[int, int]] = collections.defaultdict(dict)
    for slot, pod in slots.items():
        info = r.hgetall(p + b"p:" + pod)
        assert int(info[b"slot"]) == slot, (pod, info)
        per_pod = {c: int(m) for c, m in r.hgetall(p + b"pc:" + pod).items()}
        for bit in (1, 2, 4):
            count = sum(1 for m in per_pod.values() if m & bit)
            assert int(info.get(b"n%d" % bit, 0)) == count, (pod, bit, info)
        for chunk, mask in per_pod.items():
            assert mask > 0, (pod, chunk)
            from_pods[chunk][slot] = mask
    for chunk, row in by_chunk.items():
        assert row and row[-1] != 0, (chunk, row)  # trimmed, never empty
        held = {i + 1: m for i, m in enumerate(row) if m}
        assert held == from_pods.get(chunk, {}), (chunk, held, from_pods.get(chunk))
    assert set(from_pods) == set(by_chunk)
    refs: collections.Counter = collections.Counter()
    for key in r.scan_iter(match=p + b"si:*"):
        sid = key[len(p) + 3:]
        counts: collections.Counter = collections.Counter()
        for chunks in r.hgetall(key).values():
            counts.update(set(json.loads(chunks)))
        stored = {c.decode(): int(n) for c, n in r.hgetall(p + b"sc:" + sid).items()}
        assert stored == dict(counts), (sid, stored, counts)
        refs.update(counts.keys())
    assert {c.decode(): int(n) for c, n in r.hgetall(p + b"refs").items()} == dict(refs)


def test_kvindex_fuzz(kvindex: tuple[str, str], fuzz) -> None:  # type: ignore[no-untyped-def]
    url, store = kvindex
    with httpx.Client(base_url=url, timeout=10) as c:
        _seed(c)
        # a well-formed feed cursor this kvindex never issued is a 410 (st_hooks)
        run = fuzz(url, f"kvindex-{'memory' if store == 'memory' else 'redis'}",
                   max_examples=MAX_EXAMPLES, runtime_limit_codes=("cursor_expired",))
        run.assert_clean()
        sent = run.strings_sent()
        pods = _check_pods_consistent(c)
        n_hashes = _check_residency_consistent(c, pods, sent)
        n_sessions = _check_sessions_consistent(c, sent | {ANCHOR_SESSION})
        print(f"[fuzz] after the run: {len(pods)} pods, {n_hashes} chunk hashes located, "
              f"{n_sessions} sessions read back: consistent")
        _check_round_trip(c)
        if store != "memory":
            _check_redis_layout(store)
        _ok(c.get("/readyz"))
