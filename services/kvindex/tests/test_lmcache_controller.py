"""The kvindex as LMCache's controller: real LMCache 0.5.6 message classes, a raw worker-side
DEALER/PUSH pair, and a real ``LMCacheEngine`` (the reference engine's ``KVStore``, CPU + disk
tiers) whose own ``LMCacheWorker`` registers here and reports admits and evicts."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import msgspec  # noqa: E402
import pytest  # noqa: E402
import zmq  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from agentserving.core.hashing import HashScheme  # noqa: E402
from agentserving.core.schemas import Tier  # noqa: E402
from agentserving.kvindex.app import create_app  # noqa: E402
from agentserving.kvindex.index.memory import InMemoryIndex, InMemorySessionStore  # noqa: E402
from agentserving.kvindex.ingest.lmcache_controller import (  # noqa: E402
    LmcacheMessageError,
    decode,
    lmcache_worker_config,
    render_key,
    reply_to,
    reply_url_for,
    translate,
)
from agentserving.kvindex.settings import KvindexSettings  # noqa: E402
from testkit.servers import free_port_run  # noqa: E402

m = pytest.importorskip("lmcache.v1.cache_controller.message")

CPU, DISK = "LocalCPUBackend", "LocalDiskBackend"


def op(kind: str, key: int, seq: int) -> object:
    return m.KVOpEvent(op_type=m.OpType(kind), key=key, seq_num=seq)


def batch(instance: str, location: str, ops: list, worker: int = 0) -> object:
    return m.BatchedKVOperationMsg(instance_id=instance, worker_id=worker, location=location,
                                   operations=ops)


# ---------------------------------------------------------------- pure part

def test_translate_batched_keeps_order_and_maps_tiers():
    tr = translate(batch("pod-a", CPU, [op("admit", 0x1F, 0), op("admit", -5, 1),
                                        op("evict", 0x1F, 2), op("admit", 0x1F, 3)]))
    assert tr is not None and tr.instance_id == "pod-a" and tr.stream == (0, CPU, 0, 3)
    assert [(e.op, e.tier, e.chunk_hashes) for e in tr.events] == [
        ("stored", "cpu", ["1f", "-5"]), ("removed", "cpu", ["1f"]), ("stored", "cpu", ["1f"])]
    disk = translate(m.KVEvictMsg(instance_id="i", worker_id=1, key=7, location=DISK,
                                  seq_num=4))
    assert [(e.op, e.tier, e.chunk_hashes) for e in disk.events] == [("removed", "disk", ["7"])]
    assert disk.stream == (1, DISK, 4, 4)
    remote = translate(batch("i", "RemoteBackend", [op("admit", 1, 0)]))
    assert remote.events == [] and remote.ignored_location == "RemoteBackend"
    gone = translate(m.DeRegisterMsg(instance_id="i", worker_id=0, ip="h", port=1))
    assert [e.op for e in gone.events] == ["cleared"]
    assert translate(m.HeartbeatMsg(instance_id="i", worker_id=0, ip="h", port=1,
                                    peer_init_url=None)) is None


def test_keys_render_like_the_wire_form():
    import torch

    from agentserving.engine.kv.keys import ChunkKeys

    builtin = ChunkKeys(HashScheme.LMCACHE_BUILTIN, 16, "m", torch.float32)
    blake = ChunkKeys(HashScheme.BLAKE3, 16, "m", torch.float32)
    toks = list(range(48))
    assert [render_key(i) for i in builtin.int_hashes(toks)] == builtin.wire_hashes(toks)
    assert [render_key(i) for i in blake.int_hashes(toks)] == blake.wire_hashes(toks)
    assert render_key(1 << 200) == f"{1 << 200:064x}" and render_key(-17) == "-11"
    with pytest.raises(LmcacheMessageError):
        render_key(True)


def test_decode_msgpack_json_and_garbage():
    msg = batch("i", CPU, [op("admit", 3, 0)])
    assert decode(msgspec.msgpack.encode(msg)) == msg
    as_json = msgspec.json.encode(msg)
    assert as_json.startswith(b"{") and decode(as_json) == msg
    for bad in (b"\xc1", b"{not json", msgspec.msgpack.encode({"type": "NoSuchMsg"})):
        with pytest.raises(LmcacheMessageError):
            decode(bad)


def test_replies_are_what_the_worker_expects():
    reg = m.RegisterMsg(instance_id="i", worker_id=0, ip="h", port=1, peer_init_url=None)
    assert isinstance(reply_to(reg), m.RegisterRetMsg)
    assert "heartbeat_url" not in reply_to(reg).extra_config
    start = m.FullSyncStartMsg(instance_id="i", worker_id=0, location=CPU, sync_id="s",
                               total_keys=1, batch_count=1)
    assert reply_to(start).accepted is False and reply_to(start).sync_id == "s"
    lookup = m.BatchedP2PLookupMsg(hashes=[1], instance_id="i", worker_id=0)
    assert isinstance(reply_to(lookup), m.BatchedP2PLookupRetMsg)
    assert reply_url_for("tcp://127.0.0.1:7000") == "tcp://127.0.0.1:7001"
    assert lmcache_worker_config("tcp://10.0.0.1:7000") == {
        "enable_controller": True, "controller_pull_url": "10.0.0.1:7000",
        "controller_reply_url": "10.0.0.1:7001"}


# ---------------------------------------------------------------- sockets

@pytest.fixture
def kvindex() -> Iterator[tuple[TestClient, str, str]]:
    port = free_port_run(2)
    pull, reply = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}"
    settings = KvindexSettings(lmcache_controller=pull,
                               lmcache_instance_pods={"inst-b": "pod-b"})
    with TestClient(create_app(settings, InMemoryIndex(), InMemorySessionStore())) as client:
        for pod in ("pod-a", "pod-b"):
            r = client.post("/v1/pods", json={"pod": pod, "memory_api_url": "http://127.0.0.1:1",
                                              "model": "m", "hash_scheme": "lmcache-builtin"})
            assert r.status_code == 200, r.text
        yield client, pull, reply


def locations(client: TestClient, h: str) -> set[tuple[str, str]]:
    return {(loc["pod"], loc["tier"]) for loc in client.get(f"/v1/chunks/{h}").json()["locations"]}


def until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.02)
    raise AssertionError("condition never held")


def test_router_replies_and_pull_applies(kvindex):
    client, pull, reply = kvindex
    ctx = zmq.Context()
    dealer, push = ctx.socket(zmq.DEALER), ctx.socket(zmq.PUSH)
    for s in (dealer, push):
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 5000)
    try:
        dealer.connect(reply)
        push.connect(pull)
        # The worker's own framing: DEALER sends [b"", payload], gets [b"", reply].
        dealer.send_multipart([b"", msgspec.msgpack.encode(
            m.RegisterMsg(instance_id="inst-b", worker_id=0, ip="127.0.0.1", port=1,
                          peer_init_url=None))])
        frames = dealer.recv_multipart()
        assert frames[0] == b"" and isinstance(msgspec.msgpack.decode(frames[-1], type=m.Msg),
                                               m.RegisterRetMsg)
        dealer.send_multipart([b"", b"\xc1"])
        assert isinstance(msgspec.msgpack.decode(dealer.recv_multipart()[-1], type=m.Msg),
                          m.ErrorMsg)

        enc = msgspec.msgpack.encode
        push.send_multipart([enc(batch("inst-b", CPU, [op("admit", 0xA1, 0),
                                                       op("admit", 0xA2, 1)])),
                             enc(batch("pod-a", DISK, [op("admit", 0xA1, 0)])),
                             enc(batch("nobody", CPU, [op("admit", 0xA3, 0)]))])
        until(lambda: locations(client, "a1") == {("pod-b", "cpu"), ("pod-a", "disk")})
        assert locations(client, "a2") == {("pod-b", "cpu")}
        assert locations(client, "a3") == set()  # unregistered instance: dropped
        push.send(enc(batch("inst-b", CPU, [op("evict", 0xA2, 2)])))
        until(lambda: not locations(client, "a2"))
        assert not client.get("/v1/pods/pod-b").json()["needs_resync"]
        # LMCache's numbering skips 3..4: messages were lost, the pod must resync.
        push.send(enc(batch("inst-b", CPU, [op("admit", 0xA4, 5)])))
        until(lambda: bool(locations(client, "a4")))
        assert client.get("/v1/pods/pod-b").json()["needs_resync"]
        assert not client.get("/v1/pods/pod-a").json()["needs_resync"]
        ep = client.app.state.lmcache
        assert ep.counts["dropped"] == 1 and ep.counts["seq_gaps"] == 1
        assert ep.workers[("inst-b", 0)] == ("127.0.0.1", 1)
        push.send(enc(m.DeRegisterMsg(instance_id="pod-a", worker_id=0, ip="h", port=1)))
        until(lambda: not locations(client, "a1") - {("pod-b", "cpu")})
        assert 'kvindex_chunk_events_total{source="lmcache"}' in client.get("/metrics").text
    finally:
        dealer.close()
        push.close()
        ctx.term()


# ---------------------------------------------------------------- real LMCache

def test_real_lmcache_worker_reports_to_the_kvindex(kvindex, tmp_path: Path, monkeypatch):
    """The reference engine's KVStore (LMCacheEngine, LocalCPUBackend + LocalDiskBackend) with
    LMCache's controller enabled and pointed here: its LMCacheWorker registers over DEALER,
    then pushes BatchedKVOperationMsg for every admit and evict."""
    import torch
    from lmcache.v1.config import LMCacheEngineConfig

    from agentserving.engine.kv.keys import ChunkKeys
    from agentserving.engine.kv.store import CPU_BACKEND, DISK_BACKEND, KVStore, KVStoreConfig

    client, pull, reply = kvindex
    worker_port = free_port_run(1)
    original = LMCacheEngineConfig.from_dict.__func__  # type: ignore[attr-defined]

    def with_controller(cls, cfg):  # type: ignore[no-untyped-def]
        # KVStore builds its LMCache config itself; add only the controller keys.
        return original(cls, {**cfg, **lmcache_worker_config(pull, reply),
                              "lmcache_worker_ports": [worker_port]})

    monkeypatch.setattr(LMCacheEngineConfig, "from_dict", classmethod(with_controller))
    layers_n, heads, dim, chunk = 2, 2, 8, 16
    keys = ChunkKeys(HashScheme.LMCACHE_BUILTIN, chunk, "tiny-m", torch.float32)
    store = KVStore(KVStoreConfig(model_name="tiny-m", num_layers=layers_n, num_kv_heads=heads,
                                  head_dim=dim, dtype=torch.float32, chunk_size=chunk,
                                  cpu_gib=0.02, disk_dir=tmp_path / "disk", disk_gib=0.05,
                                  instance_id="pod-a"), keys)
    try:
        worker = store.engine.lmcache_worker
        assert worker is not None, "LMCache did not start its controller worker"
        ep = client.app.state.lmcache
        until(lambda: ("pod-a", 0) in ep.workers)  # registered through the ROUTER, got a reply

        tokens = list(range(1000, 1064))  # 4 full chunks
        gen = torch.Generator().manual_seed(0)
        layers = [(torch.randn(1, heads, len(tokens), dim, generator=gen),
                   torch.randn(1, heads, len(tokens), dim, generator=gen))
                  for _ in range(layers_n)]
        assert store.store(tokens, layers) == 4
        assert store.wait_disk_writes()
        wires = keys.wire_hashes(tokens)
        assert len(wires) == 4 and all(h == render_key(i)
                                       for h, i in zip(wires, keys.int_hashes(tokens), strict=True))
        both = {("pod-a", Tier.CPU.value), ("pod-a", Tier.DISK.value)}
        until(lambda: all(locations(client, h) == both for h in wires))
        best = client.post("/v1/lookup", json={"chunk_hashes": wires}).json()
        assert best["pods"][0]["pod"] == "pod-a" and best["pods"][0]["prefix_chunks"] == 4

        evicted, missing = store.evict(wires[2:], [CPU_BACKEND])
        assert evicted == wires[2:] and missing == []
        until(lambda: all(locations(client, h) == {("pod-a", "disk")} for h in wires[2:]))
        assert all(locations(client, h) == both for h in wires[:2])
        store.evict(wires[3:], [DISK_BACKEND])
        until(lambda: locations(client, wires[3]) == set())
        pod = client.get("/v1/pods/pod-a").json()
        assert pod["chunks"] == {"cpu": 2, "disk": 3} and not pod["needs_resync"]
        assert ep.counts.get("dropped", 0) == 0 and ep.counts.get("seq_gaps", 0) == 0
    finally:
        store.close()
