"""The vLLM pods' side of point-to-point P/D against real KV servers (plain Python, no vLLM): a
decode rank reads a prompt's chunks from the prefill pod's server into its own LMCache DRAM tier
(``PeerPull`` behind ``POST /memory/pull``, over real HTTP), the decode pod's ``HandoffPuller``
asks for it once per request, and the pods' evict, pin and unpin (``KvServerVerbs``) reach a
server."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI

from agentserving.engine.vllm.handoff import SOURCE_PARAM, HandoffPuller, KvServerVerbs
from agentserving.engine.vllm.hashes import wire_hash
from agentserving.engine.vllm.peer_pull import PeerPull, pull_router
from testkit.kvserver import CHUNK_BYTES
from testkit.servers import ThreadedServer, free_port

HASHES = (0xA1, 0xA2, 0xA3)


def test_a_decode_rank_reads_a_prompts_chunks_from_the_prefill_pods_server(
        kvserver_factory, lm_client_factory):  # type: ignore[no-untyped-def]
    prefill = kvserver_factory()
    writer = lm_client_factory(prefill.lm_port)  # what the prefill pod's LMCache wrote
    written = {}
    for h in HASHES:
        key, obj = writer.key(h), writer.chunk(h)
        writer.put(key, obj)
        written[h] = bytes(obj.byte_array)
    assert writer.exists(writer.key(HASHES[-1]))
    # the decode rank: its own DRAM tier (a real LocalCPUBackend) and its keys by wire hash
    rank = lm_client_factory(prefill.lm_port)
    by_wire = {wire_hash(h): rank.key(h) for h in (*HASHES, 0xBEEF)}
    peer = PeerPull(rank.backend, by_wire.get)
    app = FastAPI()
    app.include_router(pull_router(peer))
    api = ThreadedServer(app)
    source = f"lm://127.0.0.1:{prefill.lm_port}"
    hashes = [wire_hash(h) for h in HASHES]
    puller = HandoffPuller(api.url, own_source="lm://127.0.0.1:1", timeout_s=5)
    try:
        params = {"do_remote_prefill": True, "chunk_hashes": hashes, SOURCE_PARAM: source}
        out = puller.pull_for("req-1", params)
        assert (out.outcome, out.pulled_bytes, out.missing) == ("ok", 3 * CHUNK_BYTES, 0)
        for h, data in written.items():  # in the DRAM tier, bit-identical
            obj = rank.backend.get_blocking(rank.key(h))
            assert obj is not None and bytes(obj.byte_array) == data
            obj.ref_count_down()
        assert puller.pull_for("req-1", params) is out  # a request looked up again: once
        partial = puller.pull_for("req-2", {**params, "chunk_hashes": [hashes[0],
                                                                        wire_hash(0xBEEF)]})
        assert (partial.outcome, partial.missing, partial.pulled_bytes) == ("partial", 1, 0)
        # chunks the tier holds are not read again: the source is not even asked
        dead = f"lm://127.0.0.1:{free_port()}"
        again = puller.pull_for("req-3", {**params, SOURCE_PARAM: dead})
        assert (again.outcome, again.pulled_bytes) == ("ok", 0)
        failed = puller.pull_for("req-4", {**params, "chunk_hashes": [wire_hash(0xBEEF)],
                                           SOURCE_PARAM: dead})
        assert failed.outcome == "failed"  # the decode pod computes the prompt
        assert puller.pull_for("req-5", {**params, SOURCE_PARAM: "lm://127.0.0.1:1"}) is None
    finally:
        puller.close()
        api.stop()
        peer.close()
    verbs = KvServerVerbs(prefill.url)
    assert asyncio.run(verbs.pin(hashes[1:], 60)) == 2 and prefill.store.pinned(hashes[2])
    assert asyncio.run(verbs.unpin(hashes[1:2])) == 1 and not prefill.store.pinned(hashes[1])
    assert asyncio.run(verbs.evict(hashes[:2])) == 2
    assert prefill.store.num_chunks == 1 and prefill.store.has_chunk(hashes[2])
    gone = KvServerVerbs(f"http://127.0.0.1:{free_port()}", timeout_s=1)
    assert asyncio.run(gone.pin(hashes, 60)) is None  # the pod's own pins are not held up
