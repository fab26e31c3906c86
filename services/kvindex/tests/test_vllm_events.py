"""vLLM KV events over a real ZMQ PUB socket, array- and map-encoded, into the index."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq
from fastapi.testclient import TestClient

from agentserving.kvindex.app import create_app
from agentserving.kvindex.index.memory import InMemoryIndex, InMemorySessionStore
from agentserving.kvindex.ingest.vllm_events import VllmEventError, decode_message, translate
from agentserving.kvindex.settings import KvindexSettings
from testkit.servers import free_port


def frames(seq: int, events: list, as_map_payload: bool = False) -> list[bytes]:
    payload = {"ts": time.time(), "events": events} if as_map_payload else [time.time(), events,
                                                                            None]
    return [b"kv-events", seq.to_bytes(8, "big"), msgspec.msgpack.encode(payload)]


def stored_array(hashes, medium="GPU"):
    return ["BlockStored", hashes, None, list(range(16)), 16, None, medium]


def stored_map(hashes, medium="CPU"):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
            "token_ids": list(range(16)), "block_size": 16, "lora_id": None, "medium": medium,
            "lora_name": None}


def test_translate_both_encodings():
    events = translate([stored_array([1, 2]), stored_map([b"\x0a\xff"]),
                        ["BlockRemoved", [2], "GPU"], {"type": "BlockRemoved",
                                                       "block_hashes": [-5]},
                        ["AllBlocksCleared"], {"type": "SomethingNew"}])
    assert [(e.op, e.tier, e.chunk_hashes) for e in events] == [
        ("stored", "device", ["1", "2"]), ("stored", "cpu", ["0aff"]),
        ("removed", "device", ["2"]), ("removed", "device", ["-5"]), ("cleared", None, [])]


@pytest.mark.parametrize("bad", [
    [b"t", b"\x00" * 4, b""],                       # short seq frame
    [b"t", b"\x00" * 8, b"\xc1"],                   # not msgpack
    [b"t", b"\x00" * 8, msgspec.msgpack.encode([0, [["BlockStored", "nope", None]]])],
    [b"t", b"\x00" * 8, msgspec.msgpack.encode([0, [stored_array([1], medium="TAPE")]])],
])
def test_unreadable_messages_raise(bad):
    with pytest.raises(VllmEventError):
        decode_message(bad)


def test_real_publisher_feeds_the_index():
    port = free_port()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{port}")
    settings = KvindexSettings(vllm_event_endpoints={"vllm-0": f"tcp://127.0.0.1:{port}"})
    try:
        with TestClient(create_app(settings, InMemoryIndex(), InMemorySessionStore())) as client:
            client.post("/v1/pods", json={"pod": "vllm-0", "memory_api_url": "http://127.0.0.1:1",
                                          "model": "m"})

            def publish_until(seq, events, check, as_map=False):
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:  # PUB/SUB joins late: resend, seq dedups
                    pub.send_multipart(frames(seq, events, as_map))
                    time.sleep(0.05)
                    if check():
                        return
                raise AssertionError(f"seq {seq} never applied")

            def locations(h):
                return client.get(f"/v1/chunks/{h}").json()["locations"]

            publish_until(1, [stored_array([0xAB, 0xCD])], lambda: locations("cd"))
            assert locations("ab") == [{"pod": "vllm-0", "tier": "device"}]
            publish_until(2, [stored_map([b"\x01\x02"]), ["BlockRemoved", [0xAB], "GPU"]],
                          lambda: locations("0102"), as_map=True)
            assert locations("ab") == []
            assert locations("0102") == [{"pod": "vllm-0", "tier": "cpu"}]
            pod = client.get("/v1/pods/vllm-0").json()
            assert pod["seq"] == 2 and not pod["needs_resync"]
            publish_until(3, [["AllBlocksCleared"]], lambda: not locations("cd"))
            metrics = client.get("/metrics").text
            assert 'kvindex_chunk_events_total{source="vllm"}' in metrics
    finally:
        pub.close()
        ctx.term()
