"""The prefill side of the hand-off: pinned entries, single claim, expiry, the wire format."""

from __future__ import annotations

import json

import pytest
import torch

from agentserving.decode.handoff import wire as handoff_wire
from agentserving.decode.handoff.source import HandoffRegistry
from testkit.clock import ManualClock


def _layers(n_tokens: int = 10, n_layers: int = 3):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(1, 2, n_tokens, 4, generator=g), torch.randn(1, 2, n_tokens, 4,
                                                                        generator=g))
            for _ in range(n_layers)]


HEADER = {"model": "tiny", "num_tokens": 10, "num_layers": 3, "num_kv_heads": 2,
          "head_dim": 4, "dtype": "float32", "tokens_digest": "x", "chunk_hashes": [],
          "first_token_id": 7, "first_logprob": None, "first_top_logprobs": None}


def test_claim_once_and_expire_unclaimed():
    clock = ManualClock(100.0)
    reg = HandoffRegistry(timeout_s=5, clock=clock)
    a = reg.register(HEADER, _layers())
    b = reg.register(HEADER, _layers())
    assert reg.pending() == 2 and reg.pending_bytes() == 2 * 3 * 2 * 80 * 4
    entry = reg.claim(a)
    assert entry is not None and entry.header["transfer_id"] == a
    assert reg.claim(a) is None  # once only
    clock.now += 5.1
    assert reg.expire() == [b]
    assert reg.pending() == 0 and reg.stats.expired == 1 and reg.stats.claimed == 1
    c = reg.register(HEADER, _layers())
    clock.now += 6
    assert reg.claim(c) is None  # expired even before the sweeper ran
    assert reg.release("nope") is False


def _decode_all(chunks):
    dec = handoff_wire.Decoder()
    events = []
    for chunk in chunks:
        events += dec.feed(chunk)
    dec.finish()
    return events


def test_wire_round_trip_layer_by_layer():
    layers = _layers()
    stream = b"".join(bytes(p) for p in handoff_wire.encode(HEADER, layers))
    # feed in awkward pieces: the decoder must reassemble frames
    pieces = [stream[i:i + 97] for i in range(0, len(stream), 97)]
    events = _decode_all(pieces)
    assert events[0] == ("header", HEADER)
    got = [e for e in events if e[0] == "layer"]
    assert [e[1] for e in got] == [0, 1, 2]
    for (_, _, k, v), (k0, v0) in zip(got, layers, strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)
    assert events[-1][0] == "end"


@pytest.mark.parametrize("where", ["header", "layer", "digest"])
def test_wire_detects_any_flipped_bit(where):
    stream = bytearray(b"".join(bytes(p) for p in handoff_wire.encode(HEADER, _layers())))
    header_end = len(handoff_wire.MAGIC) + 4 + len(json.dumps(HEADER)) + handoff_wire.DIGEST
    pos = {"header": len(handoff_wire.MAGIC) + 4 + 10, "layer": header_end + 4 + 40,
           "digest": header_end - 3}[where]
    stream[pos] ^= 0x04
    with pytest.raises(handoff_wire.TransferCorrupt):
        _decode_all([bytes(stream)])


def test_wire_detects_a_short_stream():
    stream = b"".join(bytes(p) for p in handoff_wire.encode(HEADER, _layers()))
    with pytest.raises(handoff_wire.TransferCorrupt):
        _decode_all([stream[:-30]])


def test_wire_carries_only_the_suffix_after_start_token():
    layers = _layers(n_tokens=10)
    clock = ManualClock(100.0)
    reg = HandoffRegistry(timeout_s=5, clock=clock)
    entry = reg.claim(reg.register(HEADER, layers))
    part = entry.suffix(6)
    assert part.header["start_token"] == 6 and "start_token" not in entry.header
    assert part.nbytes == entry.nbytes * 4 // 10
    full = b"".join(bytes(p) for p in reg.stream(entry))
    suffix = b"".join(bytes(p) for p in reg.stream(part))
    assert len(full) - len(suffix) == 3 * 2 * (2 * 6 * 4 * 4) - len(b', "start_token": 6')
    events = _decode_all([suffix[i:i + 53] for i in range(0, len(suffix), 53)])
    assert events[0][1]["start_token"] == 6 and events[0][1]["num_tokens"] == 10
    got = [e for e in events if e[0] == "layer"]
    for (_, _, k, v), (k0, v0) in zip(got, layers, strict=True):
        assert k.shape == (1, 2, 4, 4)
        assert torch.equal(k, k0[:, :, 6:]) and torch.equal(v, v0[:, :, 6:])
    # a receiver that holds every token still gets the header and empty layers
    events = _decode_all([b"".join(bytes(p) for p in reg.stream(entry.suffix(10)))])
    assert [e[2].shape[2] for e in events if e[0] == "layer"] == [0, 0, 0]


def test_wire_refuses_a_start_token_past_the_prompt():
    bad = {**HEADER, "start_token": 11}
    stream = b"".join(bytes(p) for p in handoff_wire.encode(bad, _layers(n_tokens=0)))
    with pytest.raises(handoff_wire.TransferCorrupt, match="start_token"):
        _decode_all([stream])
