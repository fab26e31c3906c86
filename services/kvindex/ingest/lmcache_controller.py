"""Residency from unmodified LMCache / LMCache-Ascend workers: the kvindex as their controller.

LMCache's ``LMCacheWorker`` (``lmcache/v1/cache_controller/worker.py``, 0.5.6) talks to its
controller over two ZMQ sockets, with msgspec structs encoded as msgpack (or, from some
external systems, JSON objects):

- ``controller_pull_url``: the worker's **PUSH** socket connects; the controller **binds
  PULL**. Fire-and-forget ``WorkerMsg``s arrive here, several per multipart message (one
  struct per frame): ``BatchedKVOperationMsg`` (what ``LocalCPUBackend`` and
  ``LocalDiskBackend`` send on every admit/evict, through ``BatchedMessageSender``),
  ``KVAdmitMsg`` / ``KVEvictMsg`` (older single-op form), ``DeRegisterMsg``,
  ``FullSyncBatchMsg`` / ``FullSyncEndMsg``, ``RegisterMsg``.
- ``controller_reply_url``: the worker's **DEALER** socket connects; the controller **binds
  ROUTER** and must answer every request ``[identity, b"", payload]`` ->
  ``[identity, b"", reply]``. ``RegisterMsg`` is sent here first, and the worker only starts
  pushing KV operations after a reply arrives (no reply: its push loop never starts), so this
  endpoint answers ``RegisterRetMsg`` (without a ``heartbeat_url``: no heartbeats are asked
  for), ``HeartbeatRetMsg`` to a ``HeartbeatMsg``, an empty ``BatchedP2PLookupRetMsg`` (no
  peer holds anything: P2P is not brokered here), ``FullSyncStartRetMsg(accepted=False)``
  (the kvindex never asks for a full sync) and the finished ``FullSyncStatusRetMsg``.

This module has a pure part (``decode``: bytes -> LMCache message; ``translate``: message ->
the index's ``ResidencyEvent``s) and a socket part (``LmcacheControllerEndpoint``); nothing
past it sees msgpack.

Mapping:
- chunk hash: LMCache's int ``key`` (``CacheEngineKey.chunk_hash``) rendered with
  ``render_hash``. LMCache's builtin hash is a signed 64-bit Python ``hash``; an int of more
  than 64 bits can only be a blake3 digest and is written as 64 hex digits, the wire form of
  that scheme (``engine/kv/keys.py``).
- tier: the ``location`` (``str(backend)``) through ``TIER_BACKENDS`` (``LocalCPUBackend`` ->
  cpu, ``LocalDiskBackend`` -> disk); other locations (remote, P2P, GDS) are not a pod tier and
  are ignored (counted).
- pod: ``instance_pods[instance_id]``, else the ``lmcache_instance_id`` itself (the operator
  sets it to the pod name). The pod must be registered with the kvindex (by the operator or
  the pod's own registration, which carries its memory API URL and model); batches for an
  unregistered pod are counted and dropped, like the vLLM adapter's.
- order and loss: LMCache numbers operations per (instance, worker, location) sender from 0.
  The adapter gives the index its own per-pod sequence (starting from the wall clock in
  microseconds, so a restarted kvindex never replays below what a shared store has seen) and,
  when an LMCache stream skips numbers (lost messages, a kvindex restart), skips one in the
  index's sequence too, so the index flags the pod ``needs_resync``.
- ``DeRegisterMsg`` (the worker shut down: its DRAM is gone) clears the pod's residency.
  With tensor parallelism every rank reports the same chunk hashes; an admit from any rank
  marks the chunk resident and an evict from any rank removes it (the index claims no chunk
  some rank dropped).
- ``FullSyncBatchMsg`` keys are applied as stored (additive; stale chunks are not removed).

Exercised for real (``tests/test_lmcache_controller.py``): LMCache 0.5.6's own
``LMCacheWorker`` inside an ``LMCacheEngine`` with ``LocalCPUBackend`` and ``LocalDiskBackend``
(built by the reference engine's ``KVStore``), registering here, storing and evicting chunks.
Not exercised: LMCache-Ascend (same message classes per its source, not installed here), TP>1,
full sync, JSON-encoded messages from a real sender.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from agentserving.core.hashing import render_hash
from agentserving.core.logging import get_logger
from agentserving.core.schemas import TIER_BACKENDS, EventBatch, EventOp, ResidencyEvent, Tier
from agentserving.kvindex.index.base import BackendUnavailable, UnknownPod

log = get_logger(__name__)

LOCATION_TIERS: dict[str, Tier] = {backend: tier for tier, backend in TIER_BACKENDS.items()}

_BUILTIN_HASH_BITS = 64


class LmcacheMessageError(ValueError):
    """A message this adapter cannot read; it is logged and skipped, never half-applied."""


def _msg_types() -> Any:
    from lmcache.v1.cache_controller import message

    return message


def render_key(key: int) -> str:
    """LMCache's int chunk key -> the index's wire hash."""
    if isinstance(key, bool) or not isinstance(key, int):
        raise LmcacheMessageError(f"chunk key of type {type(key).__name__}")
    if key >= 1 << _BUILTIN_HASH_BITS:
        return f"{key:064x}"
    return render_hash(key)


def tier_of(location: str) -> Tier | None:
    """The pod tier of an LMCache location (backend name); None for non-local backends."""
    return LOCATION_TIERS.get(location)


def decode(part: bytes) -> Any:
    """One frame -> an LMCache message struct (msgpack, or a JSON object as LMCache accepts)."""
    m = _msg_types()
    try:
        if part.startswith(b"{"):
            return msgspec.convert(json.loads(part), type=m.Msg)
        return msgspec.msgpack.decode(part, type=m.Msg)
    except (ValueError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise LmcacheMessageError(f"unreadable LMCache message: {exc}") from exc


@dataclass
class Translated:
    """What one worker message means for the index (pure result of ``translate``)."""

    instance_id: str
    events: list[ResidencyEvent] = field(default_factory=list)
    # (worker_id, location, first seq_num, last seq_num) of the LMCache ops, for gap checks.
    stream: tuple[int, str, int, int] | None = None
    ignored_location: str | None = None


def _grouped(tier: Tier, ops: Iterable[tuple[EventOp, int]]) -> list[ResidencyEvent]:
    """Consecutive ops of one kind -> one event each run, order kept (admit, evict, admit)."""
    out: list[ResidencyEvent] = []
    for op, key in ops:
        wire = render_key(key)
        if out and out[-1].op is op:
            out[-1].chunk_hashes.append(wire)
        else:
            out.append(ResidencyEvent(op=op, tier=tier, chunk_hashes=[wire]))
    return out


def translate(msg: Any) -> Translated | None:
    """An LMCache worker message -> the index's events; None for messages without residency."""
    m = _msg_types()
    admit = {m.OpType.ADMIT: EventOp.STORED, m.OpType.EVICT: EventOp.REMOVED}
    if isinstance(msg, m.BatchedKVOperationMsg):
        out = Translated(msg.instance_id)
        if msg.operations:
            seqs = [op.seq_num for op in msg.operations]
            out.stream = (msg.worker_id, msg.location, min(seqs), max(seqs))
        tier = tier_of(msg.location)
        if tier is None:
            out.ignored_location = msg.location
            return out
        out.events = _grouped(tier, ((admit[op.op_type], op.key) for op in msg.operations))
        return out
    if isinstance(msg, m.KVOperationMsg):  # KVAdmitMsg / KVEvictMsg
        out = Translated(msg.instance_id,
                         stream=(msg.worker_id, msg.location, msg.seq_num, msg.seq_num))
        tier = tier_of(msg.location)
        if tier is None:
            out.ignored_location = msg.location
            return out
        op = EventOp.STORED if isinstance(msg, m.KVAdmitMsg) else EventOp.REMOVED
        out.events = _grouped(tier, [(op, msg.key)])
        return out
    if isinstance(msg, m.FullSyncBatchMsg):
        out = Translated(msg.instance_id)
        tier = tier_of(msg.location)
        if tier is None:
            out.ignored_location = msg.location
        elif msg.keys:
            out.events = [ResidencyEvent(op=EventOp.STORED, tier=tier,
                                         chunk_hashes=[render_key(k) for k in msg.keys])]
        return out
    if isinstance(msg, m.DeRegisterMsg):
        return Translated(msg.instance_id, events=[ResidencyEvent(op=EventOp.CLEARED)])
    return None


def reply_to(msg: Any) -> Any:
    """The answer LMCache's worker expects to a request on the ROUTER socket."""
    m = _msg_types()
    if isinstance(msg, m.RegisterMsg):
        return m.RegisterRetMsg(extra_config={})
    if isinstance(msg, m.HeartbeatMsg):
        return m.HeartbeatRetMsg()
    if isinstance(msg, m.BatchedP2PLookupMsg):
        return m.BatchedP2PLookupRetMsg(layout_info=[("", "", 0, "")])
    if isinstance(msg, m.FullSyncStartMsg):
        return m.FullSyncStartRetMsg(sync_id=msg.sync_id, accepted=False,
                                     error_msg="the kvindex does not request full syncs")
    if isinstance(msg, m.FullSyncStatusMsg):
        return m.FullSyncStatusRetMsg(sync_id=msg.sync_id, is_complete=True,
                                      global_progress=1.0, can_exit_freeze=True)
    return m.ErrorMsg(error=f"unsupported request {type(msg).__name__}")


def reply_url_for(pull_url: str) -> str:
    """The ROUTER endpoint paired with a PULL endpoint: the next port (``tcp://H:P`` -> P+1)."""
    head, sep, port = pull_url.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"'{pull_url}': expected tcp://HOST:PORT")
    return f"{head}:{int(port) + 1}"


class LmcacheControllerEndpoint:
    """The worker-facing side of LMCache's controller, applying residency to the index."""

    def __init__(self, state: Any, pull_url: str, reply_url: str | None = None,
                 instance_pods: dict[str, str] | None = None) -> None:
        self.state = state
        self.pull_url = pull_url
        self.reply_url = reply_url or reply_url_for(pull_url)
        self.instance_pods = dict(instance_pods or {})
        self._next_seq: dict[str, int] = {}
        self._stream_seq: dict[tuple[str, int, str], int] = {}
        self._seq_base = time.time_ns() // 1000
        self._gap: set[str] = set()
        self.workers: dict[tuple[str, int], tuple[str, int]] = {}  # registered: -> (ip, port)
        self.counts: dict[str, int] = {}

    def pod_of(self, instance_id: str) -> str:
        return self.instance_pods.get(instance_id, instance_id)

    def _count(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n

    def _note_stream(self, pod: str, tr: Translated) -> None:
        """Track LMCache's per-sender numbering; a skip means lost messages for ``pod``."""
        if tr.stream is None:
            return
        worker, location, first, last = tr.stream
        key = (tr.instance_id, worker, location)
        prev = self._stream_seq.get(key)
        expected = 0 if prev is None else prev + 1
        if first > expected:
            log.warning("lmcache_seq_gap", pod=pod, worker=worker, location=location,
                        expected=expected, got=first)
            self._count("seq_gaps")
            self._gap.add(pod)
        self._stream_seq[key] = last if prev is None else max(last, prev)

    def _seq_for(self, pod: str) -> int:
        """The index seq of the next batch for ``pod``: skips one after lost messages."""
        seq = self._next_seq.get(pod, self._seq_base) + (2 if pod in self._gap else 1)
        self._gap.discard(pod)
        self._next_seq[pod] = seq
        return seq

    async def handle_push(self, msg: Any) -> None:
        """Apply one pushed worker message."""
        m = _msg_types()
        if isinstance(msg, m.RegisterMsg):
            self.workers[(msg.instance_id, msg.worker_id)] = (msg.ip, msg.port)
            return
        tr = translate(msg)
        if tr is None:
            self._count("ignored")
            return
        if isinstance(msg, m.DeRegisterMsg):
            self.workers.pop((msg.instance_id, msg.worker_id), None)
        pod = self.pod_of(tr.instance_id)
        self._note_stream(pod, tr)
        if tr.ignored_location is not None:
            self._count("ignored_location")
            log.debug("lmcache_location_ignored", pod=pod, location=tr.ignored_location)
            return
        if not tr.events:
            return
        st = self.state
        seq = self._seq_for(pod)
        try:
            result = await st.index.apply_events(EventBatch(pod=pod, seq=seq, events=tr.events))
        except (UnknownPod, BackendUnavailable) as exc:
            log.warning("lmcache_event_dropped", pod=pod, seq=seq, error=str(exc))
            st.metrics.batches.labels("dropped").inc()
            self._count("dropped")
            return
        st.metrics.batches.labels("applied" if result.applied else "replay").inc()
        st.metrics.chunk_events.labels("lmcache").inc(result.chunk_events)
        self._count("applied")

    async def handle_request(self, msg: Any) -> Any:
        m = _msg_types()
        if isinstance(msg, m.RegisterMsg):
            self.workers[(msg.instance_id, msg.worker_id)] = (msg.ip, msg.port)
            log.info("lmcache_worker_registered", instance=msg.instance_id,
                     worker=msg.worker_id, pod=self.pod_of(msg.instance_id))
        return reply_to(msg)

    async def _pull_loop(self, sock: Any) -> None:
        while True:
            frames = await sock.recv_multipart()
            for part in frames:
                try:
                    msg = decode(part)
                except LmcacheMessageError as exc:
                    log.warning("lmcache_message_unreadable", error=str(exc))
                    self.state.metrics.batches.labels("unreadable").inc()
                    self._count("unreadable")
                    continue
                await self.handle_push(msg)

    async def _router_loop(self, sock: Any) -> None:
        m = _msg_types()
        while True:
            frames = await sock.recv_multipart()
            if len(frames) < 3:
                self._count("unreadable")
                continue
            identity, payload = frames[0], frames[-1]
            try:
                ret = await self.handle_request(decode(payload))
            except LmcacheMessageError as exc:
                self._count("unreadable")
                ret = m.ErrorMsg(error=str(exc))
            await sock.send_multipart([identity, b"", msgspec.msgpack.encode(ret)])

    async def run(self) -> None:
        """Bind PULL and ROUTER and serve until cancelled."""
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context.instance()
        pull = ctx.socket(zmq.PULL)
        router = ctx.socket(zmq.ROUTER)
        for sock in (pull, router):
            sock.setsockopt(zmq.LINGER, 0)
        try:
            pull.bind(self.pull_url)
            router.bind(self.reply_url)
            log.info("lmcache_controller_listening", pull=self.pull_url, reply=self.reply_url)
            await asyncio.gather(self._pull_loop(pull), self._router_loop(router))
        finally:
            pull.close()
            router.close()


def lmcache_worker_config(pull_url: str, reply_url: str | None = None) -> dict[str, Any]:
    """The LMCache config keys that point a worker at this endpoint (``tcp://`` stripped:
    LMCache adds it)."""
    def bare(url: str) -> str:
        return url.removeprefix("tcp://")

    return {"enable_controller": True, "controller_pull_url": bare(pull_url),
            "controller_reply_url": bare(reply_url or reply_url_for(pull_url))}


async def serve(state: Any, pull_url: str, reply_url: str | None = None,
                instance_pods: dict[str, str] | None = None) -> None:
    await LmcacheControllerEndpoint(state, pull_url, reply_url, instance_pods).run()


__all__: Sequence[str] = (
    "LOCATION_TIERS", "LmcacheControllerEndpoint", "LmcacheMessageError", "Translated", "decode",
    "lmcache_worker_config", "render_key", "reply_to", "reply_url_for", "serve", "tier_of",
    "translate",
)
