"""The KV server's HTTP API over real HTTP, with LMCache's own client filling and reading the
stores: evict by chunk hash, listing, export, pull between two servers, and bad input."""

from __future__ import annotations

import socket

import httpx
import pytest
from lmcache.utils import parse_cache_key

from agentserving.engine.kvserver.records import MAGIC, RecordError, RecordReader
from agentserving.engine.vllm.hashes import wire_hash
from testkit.kvserver import CHUNK_BYTES
from testkit.servers import ThreadedServer, free_port

H1, H2, H3 = 0x1111, -0x2222, 0x3333


def fill(client, hashes, workers=(0,)):  # type: ignore[no-untyped-def]
    """Put one chunk per (hash, worker) -- two workers: a chunk held by two TP ranks -- and
    return {key string: the bytes put}."""
    put = {}
    for i, h in enumerate(hashes):
        for w in workers:
            key, obj = client.key(h, worker_id=w), client.chunk(100 * i + w)
            client.put(key, obj)
            put[key.to_string()] = bytes(obj.byte_array)
    assert client.exists(client.key(hashes[-1], worker_id=workers[-1]))  # every PUT stored
    return put


def test_evict_by_chunk_hash_frees_exactly_those_keys(kvserver, lm_client_factory):
    client = lm_client_factory(kvserver.lm_port)
    fill(client, [H1, H2, H3], workers=(0, 1))
    r = httpx.post(f"{kvserver.url}/memory/evict",
                   json={"chunk_hashes": [wire_hash(H1), wire_hash(H3), "abc"],
                         "locations": ["LocalCPUBackend"]})
    assert r.status_code == 200, r.text
    assert r.json() == {"status": "success", "num_evicted": 2, "num_keys": 4,
                        "freed_bytes": 4 * CHUNK_BYTES, "num_missing": 1, "missing": ["abc"]}
    assert [client.exists(client.key(h, w)) for h in (H1, H2, H3) for w in (0, 1)] == [
        False, False, True, True, False, False]
    assert kvserver.metric("agentserving_kvserver_evictions_total", 'reason="evict"') == 4
    assert kvserver.metric("agentserving_kvserver_evicted_bytes_total",
                           'reason="evict"') == 4 * CHUNK_BYTES
    assert kvserver.metric("agentserving_kvserver_stored_bytes") == 2 * CHUNK_BYTES
    assert kvserver.metric("agentserving_kvserver_chunks") == 1
    assert kvserver.metric("agentserving_kvserver_keys") == 2


def test_chunks_lists_what_is_held_with_keys_and_bytes(kvserver, lm_client_factory):
    client = lm_client_factory(kvserver.lm_port)
    put = fill(client, [H1, H2], workers=(0, 1))
    body = httpx.get(f"{kvserver.url}/v1/chunks").json()
    assert body["total_chunks"] == 2 and body["used_bytes"] == 4 * CHUNK_BYTES
    assert body["capacity_bytes"] == 1 << 20
    listed = {c["chunk_hash"]: c for c in body["chunks"]}
    assert set(listed) == {wire_hash(H1), wire_hash(H2)}
    assert sorted(k for c in listed.values() for k in c["keys"]) == sorted(put)
    assert all(c["bytes"] == 2 * CHUNK_BYTES for c in listed.values())
    page = httpx.get(f"{kvserver.url}/v1/chunks", params={"offset": 1, "limit": 1}).json()
    assert [c["chunk_hash"] for c in page["chunks"]] == [sorted(listed)[1]]


def test_pull_moves_chunks_bit_identical_and_reports_missing(kvserver_factory,
                                                            lm_client_factory):
    prefill, decode = kvserver_factory(), kvserver_factory()
    put = fill(lm_client_factory(prefill.lm_port), [H1, H2, H3], workers=(0, 1))
    wanted = [wire_hash(H1), wire_hash(H3), "beef"]
    r = httpx.post(f"{decode.url}/v1/pull", json={"source": prefill.url, "chunk_hashes": wanted})
    assert r.status_code == 200, r.text
    out = r.json()
    assert (out["pulled_chunks"], out["pulled_keys"], out["pulled_bytes"]) == (
        2, 4, 4 * CHUNK_BYTES)
    assert out["missing"] == ["beef"] and out["already_held"] == [] and out["seconds"] > 0
    reader = lm_client_factory(decode.lm_port)
    for h in (H1, H3):
        for w in (0, 1):
            key = reader.key(h, w)
            got = reader.get(key)
            assert got is not None and bytes(got.byte_array) == put[key.to_string()]
            assert got.get_shape() == reader.chunk(0).get_shape()
    assert not reader.exists(reader.key(H2))
    assert decode.metric("agentserving_kvserver_pull_bytes_total") == 4 * CHUNK_BYTES
    assert decode.metric("agentserving_kvserver_pull_keys_total") == 4
    assert prefill.metric("agentserving_kvserver_export_bytes_total") == 4 * CHUNK_BYTES
    # what is held already is not fetched again
    again = httpx.post(f"{decode.url}/v1/pull",
                       json={"source": prefill.url, "chunk_hashes": wanted[:2]}).json()
    assert (again["pulled_keys"], again["already_held"]) == (0, wanted[:2])
    assert prefill.metric("agentserving_kvserver_export_bytes_total") == 4 * CHUNK_BYTES


def test_pull_from_a_dead_or_wrong_source_is_a_502_naming_source(kvserver):
    dead = f"http://127.0.0.1:{free_port()}"
    for source in (dead, f"{kvserver.url}/not-a-kvserver"):
        r = httpx.post(f"{kvserver.url}/v1/pull",
                       json={"source": source, "chunk_hashes": ["ab"]})
        assert r.status_code == 502, r.text
        assert r.json()["error"]["param"] == "source" and source in r.json()["error"]["message"]
    assert len(kvserver.store) == 0


def test_pull_from_a_source_that_never_answers_is_a_504(kvserver):
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        source = f"http://127.0.0.1:{silent.getsockname()[1]}"
        r = httpx.post(f"{kvserver.url}/v1/pull",
                       json={"source": source, "chunk_hashes": ["ab"], "timeout_s": 0.5},
                       timeout=10)
    assert r.status_code == 504, r.text
    assert r.json()["error"]["param"] == "source"


def test_export_is_a_record_stream_of_the_chunks_held(kvserver, lm_client_factory):
    put = fill(lm_client_factory(kvserver.lm_port), [H1, H2])
    r = httpx.post(f"{kvserver.url}/v1/export",
                   json={"chunk_hashes": [wire_hash(H2), "ff"]})
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
    reader = RecordReader()
    blobs = [b for i in range(0, len(r.content), 7) for b in reader.feed(r.content[i:i + 7])]
    assert reader.done
    assert [(b.key, b.chunk, b.data) for b in blobs] == [
        (k, wire_hash(H2), v) for k, v in put.items() if parse_cache_key(k).chunk_hash == H2]
    # a stream cut short, or one that is no export, never passes as complete
    cut = RecordReader()
    assert cut.feed(r.content[:-10]) == [] and not cut.done
    with pytest.raises(RecordError, match="magic"):
        RecordReader().feed(b"<html>" + r.content)
    with pytest.raises(RecordError, match="after the end"):
        RecordReader().feed(r.content + b"x")
    assert r.content.startswith(MAGIC)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/memory/evict", {"chunk_hashes": ["XYZ"]}, "chunk_hashes[0]"),
    ("/memory/evict", {"chunk_hashes": "ab"}, "chunk_hashes"),
    ("/memory/evict", {"chunk_hashes": [], "pods": []}, "pods"),
    ("/memory/evict", {"chunk_hashes": [], "locations": ["cpu", "tape"]}, "locations[1]"),
    ("/v1/export", {}, "chunk_hashes"),
    ("/v1/pull", {"source": "ftp://x", "chunk_hashes": []}, "source"),
    ("/v1/pull", {"source": "http://x", "chunk_hashes": ["ab", "Q"]}, "chunk_hashes[1]"),
    ("/v1/pull", {"source": "http://x", "chunk_hashes": [], "timeout_s": "5"}, "timeout_s"),
    ("/v1/pull", {"source": "http://x", "chunk_hashes": [], "timeout_s": 0}, "timeout_s"),
    ("/v1/pull", {"chunk_hashes": []}, "source"),
])
def test_bad_bodies_are_400s_naming_the_field(kvserver, path, body, param):
    r = httpx.post(f"{kvserver.url}{path}", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_limits_are_4xx_naming_the_field(kvserver_factory):
    server = kvserver_factory(max_batch_chunks=2)
    r = httpx.post(f"{server.url}/memory/evict", json={"chunk_hashes": ["a", "b", "c"]})
    assert r.status_code == 413 and r.json()["error"]["param"] == "chunk_hashes"
    r = httpx.get(f"{server.url}/v1/chunks", params={"limit": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit"


def test_with_an_internal_token_peers_pull_and_strangers_are_refused(kvserver_factory,
                                                                     lm_client_factory):
    token = "s3cret"
    a, b = kvserver_factory(internal_token=token), kvserver_factory(internal_token=token)
    fill(lm_client_factory(a.lm_port), [H1])
    body = {"source": a.url, "chunk_hashes": [wire_hash(H1)]}
    assert httpx.post(f"{b.url}/v1/pull", json=body).status_code == 401
    r = httpx.post(f"{b.url}/v1/pull", json=body, headers={"authorization": f"Bearer {token}"})
    assert r.status_code == 200 and r.json()["pulled_keys"] == 1
    assert httpx.get(f"{a.url}/healthz").status_code == 200  # probes stay open


def test_openapi_documents_every_route(kvserver):
    paths = httpx.get(f"{kvserver.url}/openapi.json").json()["paths"]
    assert {"/v1/chunks", "/memory/evict", "/v1/export", "/v1/pull", "/healthz"} <= set(paths)
    assert {"502", "504"} <= set(paths["/v1/pull"]["post"]["responses"])


def test_a_bad_or_cut_export_stream_is_a_502_and_stores_only_whole_records(
        kvserver_factory, lm_client_factory):
    """A peer that sends garbage, or cuts its stream in the middle of a record, costs the pull
    what was not whole: the records before the cut are stored, nothing partial is."""
    from fastapi import FastAPI
    from fastapi.responses import Response

    source, target = kvserver_factory(), kvserver_factory()
    put = fill(lm_client_factory(source.lm_port), [H1, H2])
    wanted = [wire_hash(H1), wire_hash(H2)]
    whole = httpx.post(f"{source.url}/v1/export", json={"chunk_hashes": wanted}).content
    first_record = len(MAGIC) + (len(whole) - len(MAGIC) - 4) // 2
    bodies = {"garbage": b"<html>not an export</html>",
              "cut": whole[:first_record + 100],  # one whole record, then part of the next
              "bad-key": whole.replace(b"kvs-test@1@0@", b"kvs-test@x@0@", 1)}
    peer = FastAPI()

    @peer.post("/{name}/v1/export")
    async def export(name: str) -> Response:
        return Response(bodies[name], media_type="application/octet-stream")

    fake = ThreadedServer(peer)
    try:
        for name in ("garbage", "bad-key", "cut"):
            r = httpx.post(f"{target.url}/v1/pull",
                           json={"source": f"{fake.url}/{name}", "chunk_hashes": wanted})
            assert r.status_code == 502, (name, r.text)
            assert r.json()["error"]["param"] == "source"
            if name != "cut":
                assert len(target.store) == 0, name
    finally:
        fake.stop()
    assert len(target.store) == 1  # the cut stream's first record, whole
    (key,) = target.store.lru_keys()
    assert target.store.get(key).data == put[key]


def test_pinned_chunks_survive_lmcache_puts_and_are_reported_by_pin_state(kvserver_factory,
                                                                         lm_client_factory):
    """LMCache's own client fills a server of four chunks' room; two pinned chunks (half the
    bound, the default share) outlive the puts that evict every other old chunk."""
    server = kvserver_factory(capacity_bytes=4 * CHUNK_BYTES)
    client = lm_client_factory(server.lm_port)
    old = [0x10 + i for i in range(4)]
    fill(client, old)
    pinned = [wire_hash(old[0]), wire_hash(old[1])]
    r = httpx.post(f"{server.url}/memory/pin",
                   json={"chunk_hashes": [*pinned, "beef"], "ttl_s": 60})
    assert r.status_code == 200, r.text
    assert r.json() == {"num_pinned": 2, "num_extended": 0, "num_missing": 1, "num_refused": 0}
    fill(client, [0x20 + i for i in range(3)])  # three new chunks: room made by the LRU
    assert [client.exists(client.key(h)) for h in old] == [True, True, False, False]
    listing = httpx.get(f"{server.url}/v1/chunks").json()
    assert (listing["pinned_chunks"], listing["pinned_bytes"]) == (2, 2 * CHUNK_BYTES)
    assert sorted(c["chunk_hash"] for c in listing["chunks"] if c["pinned"]) == sorted(pinned)
    assert server.metric("agentserving_kvserver_chunks_by_pin", 'pinned="true"') == 2
    assert server.metric("agentserving_kvserver_bytes_by_pin",
                         'pinned="false"') == 2 * CHUNK_BYTES
    assert server.metric("agentserving_kvserver_pins_total", 'outcome="missing"') == 1
    r = httpx.post(f"{server.url}/memory/unpin", json={"chunk_hashes": pinned[:1]})
    assert r.json() == {"num_unpinned": 1}
    fill(client, [0x30])  # the unpinned one is the oldest again: it goes first
    assert [client.exists(client.key(h)) for h in old[:2]] == [False, True]
    bad = httpx.post(f"{server.url}/memory/pin", json={"chunk_hashes": ["ab"], "ttl_s": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "ttl_s"
