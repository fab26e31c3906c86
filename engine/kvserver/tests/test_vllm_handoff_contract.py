"""The vLLM pods' side of the KV server's API, against real servers: a decode pod's
``HandoffPuller`` pulls through its own server from the prefill pod's, and the pods' evict
(``evict_on_server``) reaches it. Both are plain Python (no vLLM)."""

from __future__ import annotations

import asyncio

from agentserving.engine.vllm.handoff import SOURCE_PARAM, HandoffPuller, evict_on_server
from agentserving.engine.vllm.hashes import wire_hash
from testkit.kvserver import CHUNK_BYTES
from testkit.servers import free_port


def test_a_decode_pod_pulls_a_prompts_chunks_through_its_own_server(kvserver_factory,
                                                                   lm_client_factory):
    prefill, decode = kvserver_factory(), kvserver_factory()
    writer = lm_client_factory(prefill.lm_port)
    put = {}
    for h in (0xa1, 0xa2, 0xa3):
        key, obj = writer.key(h), writer.chunk(h)
        writer.put(key, obj)
        put[h] = bytes(obj.byte_array)
    assert writer.exists(writer.key(0xa3))
    hashes = [wire_hash(h) for h in (0xa1, 0xa2, 0xa3)]
    puller = HandoffPuller(decode.url, own_source=decode.url, timeout_s=5)
    try:
        params = {"do_remote_prefill": True, "chunk_hashes": hashes, SOURCE_PARAM: prefill.url}
        out = puller.pull_for("req-1", params)
        assert (out.outcome, out.pulled_bytes, out.missing) == ("ok", 3 * CHUNK_BYTES, 0)
        reader = lm_client_factory(decode.lm_port)  # what LMCache on the decode pod loads
        for h, data in put.items():
            assert bytes(reader.get(reader.key(h)).byte_array) == data
        partial = puller.pull_for("req-2", {**params, "chunk_hashes": [hashes[0], "beef"]})
        assert (partial.outcome, partial.missing, partial.pulled_bytes) == ("partial", 1, 0)
        # chunks held already are not fetched again: the source is not even asked
        again = puller.pull_for("req-3", {**params, SOURCE_PARAM:
                                          f"http://127.0.0.1:{free_port()}"})
        assert (again.outcome, again.pulled_bytes) == ("ok", 0)
        dead = puller.pull_for("req-4", {**params, "chunk_hashes": ["beef"], SOURCE_PARAM:
                                         f"http://127.0.0.1:{free_port()}"})
        assert dead.outcome == "failed"  # the decode pod computes the prompt
    finally:
        puller.close()
    assert asyncio.run(evict_on_server(decode.url, hashes[:2])) == 2
    assert decode.store.num_chunks == 1 and decode.store.has_chunk(hashes[2])
