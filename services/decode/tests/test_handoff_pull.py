"""The decode side of the hand-off over real HTTP: pull, verify, load layer by layer."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import uvicorn
from fastapi import FastAPI

from agentserving.core.service import install_error_handlers
from agentserving.decode.handoff import wire as handoff_wire
from agentserving.decode.handoff.pull import RemoteKV, TransferError, layerwise_cache
from agentserving.decode.handoff.source import HandoffRegistry, handoff_router
from agentserving.engine.model.loader import load_model
from agentserving.engine.model.runner import ModelRunner
from testkit.servers import free_port


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model("tiny")


@pytest.fixture
def server():
    reg = HandoffRegistry(timeout_s=30)
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(handoff_router(reg))
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.01)
    yield reg, port
    srv.should_exit = True
    thread.join(5)


def _prefill(tiny, ids):
    runner = ModelRunner(tiny)
    cache = runner.new_cache()
    runner.forward(ids[:256], cache, 0)
    logits = runner.forward(ids[256:], cache, 256)
    first = int(torch.argmax(logits))
    header = {"model": "tiny", "num_tokens": len(ids), "num_layers": tiny.num_layers,
              "num_kv_heads": tiny.num_kv_heads, "head_dim": tiny.head_dim,
              "dtype": "float32", "tokens_digest": handoff_wire.tokens_digest(ids),
              "chunk_hashes": [], "first_token_id": first, "first_logprob": None,
              "first_top_logprobs": None}
    return runner, cache, header, first


def _remote(tiny, reg_port, transfer_id, ids):
    params = {"remote_host": "127.0.0.1", "remote_port": reg_port, "transfer_id": transfer_id}
    return RemoteKV(params, ids, num_layers=tiny.num_layers, num_kv_heads=tiny.num_kv_heads,
                    head_dim=tiny.head_dim, dtype=tiny.dtype, timeout_s=10).start()


def test_layerwise_pull_continues_exactly_like_the_prefill_pod(tiny, server):
    reg, port = server
    ids = list(range(300, 700))
    runner, cache, header, first = _prefill(tiny, ids)
    tid = reg.register(header, runner.cache_layers(cache))
    remote = _remote(tiny, port, tid, ids)
    assert remote.wait_header()["first_token_id"] == first
    pulled = layerwise_cache(tiny.config, remote, len(ids))
    got = runner.forward([first], pulled, len(ids))  # consumes layers as they arrive
    want = runner.forward([first], cache, len(ids))
    assert torch.equal(got, want)
    remote.wait_done()
    assert remote.bytes_received > len(ids) * tiny.kv_bytes_per_token
    assert reg.pending() == 0 and reg.stats.claimed == 1
    assert reg.stats.bytes_sent == remote.bytes_received


def test_pull_of_unknown_or_mismatched_transfer_fails_cleanly(tiny, server):
    reg, port = server
    ids = list(range(300, 700))
    with pytest.raises(TransferError):
        _remote(tiny, port, "nope", ids).wait_header()
    runner, cache, header, _ = _prefill(tiny, ids)
    tid = reg.register(header, runner.cache_layers(cache))
    other_prompt = list(range(301, 701))
    with pytest.raises(TransferError, match="tokens_digest"):
        _remote(tiny, port, tid, other_prompt).wait_header()
    with pytest.raises(TransferError):
        RemoteKV({"remote_host": "127.0.0.1"}, ids, num_layers=1, num_kv_heads=1, head_dim=1,
                 dtype=torch.float32, timeout_s=1)


def test_corrupted_layer_in_flight_raises_inside_the_forward_pass(tiny, server, monkeypatch):
    reg, port = server
    ids = list(range(300, 700))
    runner, cache, header, first = _prefill(tiny, ids)
    tid = reg.register(header, runner.cache_layers(cache))
    original = reg.stream

    def tampered(entry):
        big = 0
        for piece in original(entry):
            piece = bytes(piece)
            if len(piece) > 1000:  # keys, values, keys, ... of each layer in turn
                big += 1
                if big == 5:  # the third layer's keys
                    piece = piece[:100] + bytes([piece[100] ^ 1]) + piece[101:]
            yield piece

    monkeypatch.setattr(reg, "stream", tampered)
    remote = _remote(tiny, port, tid, ids)
    remote.wait_header()
    pulled = layerwise_cache(tiny.config, remote, len(ids))
    with pytest.raises(TransferError, match="checksum"):
        runner.forward([first], pulled, len(ids))


def _remote_from(tiny, port, transfer_id, ids, prefix, hashes=()):
    params = {"remote_host": "127.0.0.1", "remote_port": port, "transfer_id": transfer_id}
    return RemoteKV(params, ids, num_layers=tiny.num_layers, num_kv_heads=tiny.num_kv_heads,
                    head_dim=tiny.head_dim, dtype=tiny.dtype, timeout_s=10, prefix=prefix,
                    prefix_chunk_hashes=hashes).start()


def test_pull_with_a_local_prefix_asks_only_for_the_suffix(tiny, server):
    reg, port = server
    ids = list(range(300, 700))
    runner, cache, header, first = _prefill(tiny, ids)
    header = {**header, "chunk_hashes": ["c0"]}
    full_bytes = sum(k.numel() * 4 * 2 for k, _ in runner.cache_layers(cache))
    # what the decode pod kept of the previous turn: the first chunk, as separate tensors
    prefix = [(k[:, :, :256].clone(), v[:, :, :256].clone())
              for k, v in runner.cache_layers(cache)]
    tid = reg.register(header, runner.cache_layers(cache))
    remote = _remote_from(tiny, port, tid, ids, prefix, ["c0"])
    assert remote.wait_header()["start_token"] == 256
    pulled = layerwise_cache(tiny.config, remote, len(ids))
    got = runner.forward([first], pulled, len(ids))
    want = runner.forward([first], cache, len(ids))
    assert torch.equal(got, want)
    remote.wait_done()
    assert remote.start_token == 256
    assert full_bytes * 144 // 400 < remote.bytes_received < full_bytes * 160 // 400
    assert reg.stats.tokens_skipped == 256 and reg.stats.bytes_sent == remote.bytes_received


def test_pull_refuses_a_local_prefix_whose_chunks_differ(tiny, server):
    reg, port = server
    ids = list(range(300, 700))
    runner, cache, header, _ = _prefill(tiny, ids)
    tid = reg.register({**header, "chunk_hashes": ["c0"]}, runner.cache_layers(cache))
    prefix = [(k[:, :, :256], v[:, :, :256]) for k, v in runner.cache_layers(cache)]
    with pytest.raises(TransferError, match="chunk hashes"):
        _remote_from(tiny, port, tid, ids, prefix, ["other"]).wait_header()
