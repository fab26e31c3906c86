"""Residency from stock vLLM: its KV event stream (``--kv-events-config``, ZMQ PUB).

vLLM publishes multipart messages ``[topic, seq (8-byte big-endian), payload]``; the payload is
msgpack ``[ts, events, dp_rank?]`` and each event is either a tagged array
(``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
...]``) or, in newer versions, a map with a ``"type"`` key. This adapter turns both into the
index's own ``EventBatch``; nothing past this module sees msgpack.

vLLM's block hashes name its own blocks (``block_size`` tokens, its own hash function), so
they are indexed as they come (rendered as hex): a lookup for them must use vLLM's hashes too.
The pod must be registered with the kvindex (by the operator or its own registration); events
for an unregistered pod are counted and dropped, and the next accepted batch shows the gap.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import msgspec

from agentserving.core.hashing import render_hash
from agentserving.core.logging import get_logger
from agentserving.core.schemas import EventBatch, EventOp, ResidencyEvent, Tier
from agentserving.kvindex.index.base import BackendUnavailable, UnknownPod

log = get_logger(__name__)

_MEDIUM_TIERS = {None: Tier.DEVICE, "GPU": Tier.DEVICE, "NPU": Tier.DEVICE, "HBM": Tier.DEVICE,
                 "CPU": Tier.CPU, "DRAM": Tier.CPU, "DISK": Tier.DISK, "SSD": Tier.DISK}

# Field order of the array encoding (msgspec array_like structs, tag first).
_ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


class VllmEventError(ValueError):
    """A message this adapter cannot read; it is logged and skipped, never half-applied."""


def _as_map(event: Any) -> dict[str, Any]:
    if isinstance(event, dict):
        if "type" not in event:
            raise VllmEventError(f"event map without 'type': {sorted(event)}")
        return event
    if isinstance(event, list | tuple) and event and isinstance(event[0], str):
        kind = event[0]
        if kind not in _ARRAY_FIELDS:
            return {"type": kind}
        return {"type": kind, **dict(zip(_ARRAY_FIELDS[kind], event[1:], strict=False))}
    raise VllmEventError(f"unreadable event: {event!r:.80}")


def _tier(medium: Any) -> Tier:
    key = medium.upper() if isinstance(medium, str) else medium
    if key not in _MEDIUM_TIERS:
        raise VllmEventError(f"unknown medium {medium!r}")
    return _MEDIUM_TIERS[key]


def _hashes(values: Any) -> list[str]:
    if not isinstance(values, list | tuple):
        raise VllmEventError("block_hashes must be a list")
    out = []
    for value in values:
        if not isinstance(value, int | bytes) or isinstance(value, bool):
            raise VllmEventError(f"block hash of type {type(value).__name__}")
        out.append(render_hash(value))
    return out


def translate(events: Sequence[Any]) -> list[ResidencyEvent]:
    """vLLM events (array- or map-encoded) -> the index's residency events."""
    out: list[ResidencyEvent] = []
    for raw in events:
        event = _as_map(raw)
        kind = event["type"]
        if kind == "BlockStored":
            out.append(ResidencyEvent(op=EventOp.STORED, tier=_tier(event.get("medium")),
                                      chunk_hashes=_hashes(event.get("block_hashes", []))))
        elif kind == "BlockRemoved":
            out.append(ResidencyEvent(op=EventOp.REMOVED, tier=_tier(event.get("medium")),
                                      chunk_hashes=_hashes(event.get("block_hashes", []))))
        elif kind == "AllBlocksCleared":
            out.append(ResidencyEvent(op=EventOp.CLEARED))
        else:
            log.debug("vllm_event_ignored", type=kind)
    return out


def decode_message(frames: Sequence[bytes]) -> tuple[int, list[ResidencyEvent]]:
    """``[topic, seq, payload]`` -> (seq, events). Raises VllmEventError on anything else."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise VllmEventError(f"expected [topic, 8-byte seq, payload], got {len(frames)} frames")
    seq = int.from_bytes(frames[1], "big", signed=False)
    try:
        payload = msgspec.msgpack.decode(frames[2])
    except msgspec.DecodeError as exc:
        raise VllmEventError(f"payload is not msgpack: {exc}") from exc
    if isinstance(payload, dict):
        events = payload.get("events")
    elif isinstance(payload, list | tuple) and len(payload) >= 2:
        events = payload[1]
    else:
        raise VllmEventError("payload is neither [ts, events, dp_rank] nor a map")
    if not isinstance(events, list | tuple):
        raise VllmEventError("payload events must be a list")
    return seq, translate(events)


async def subscribe(state: Any, pod: str, endpoint: str, topic: bytes = b"") -> None:
    """Apply one vLLM publisher's events to the index until cancelled."""
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, topic)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    log.info("vllm_events_subscribed", pod=pod, endpoint=endpoint)
    try:
        while True:
            frames = await sock.recv_multipart()
            try:
                seq, events = decode_message(frames)
            except VllmEventError as exc:
                log.warning("vllm_event_unreadable", pod=pod, error=str(exc))
                state.metrics.batches.labels("unreadable").inc()
                continue
            try:
                result = await state.index.apply_events(EventBatch(pod=pod, seq=seq, events=events))
            except (UnknownPod, BackendUnavailable) as exc:
                log.warning("vllm_event_dropped", pod=pod, seq=seq, error=str(exc))
                state.metrics.batches.labels("dropped").inc()
                continue
            state.metrics.batches.labels("applied" if result.applied else "replay").inc()
            state.metrics.chunk_events.labels("vllm").inc(result.chunk_events)
    finally:
        sock.close()


async def subscribe_forever(state: Any, endpoints: dict[str, str]) -> None:
    await asyncio.gather(*(subscribe(state, pod, ep) for pod, ep in endpoints.items()))
