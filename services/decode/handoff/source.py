"""The prefill side of the P/D hand-off: KV kept pinned until a decode pod pulls it.

After a prefill with ``kv_transfer_params: {"do_remote_decode": true}`` the engine registers
the request's whole prompt KV (the trailing partial chunk included, which LMCache never
stores) with the first sampled token, and answers with where to pull it from. A decode pod
pulls it once with ``GET /v1/kv/{transfer_id}`` on this engine process's HTTP port (the
stream format is ``decode.handoff.wire``). A decode pod that already holds the prompt's
first tokens (the chunks of the session's previous turn, in its own tiers) asks only for the
rest with ``?start=N``: the stream then carries tokens ``[N, num_tokens)`` of every layer,
each frame still checksummed, and its header says ``start_token: N``. The entry is released
when the pull completes, or after ``timeout_s`` if nobody claims it.
``DELETE /v1/kv/{transfer_id}`` releases it early.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from fastapi import APIRouter, Query
from fastapi.responses import Response, StreamingResponse

from agentserving.core.logging import get_logger
from agentserving.core.service import ApiError, error_responses
from agentserving.decode.handoff import wire

log = get_logger(__name__)


@dataclasses.dataclass
class HandoffEntry:
    transfer_id: str
    header: dict[str, Any]
    layers: Sequence[tuple[torch.Tensor, torch.Tensor]]
    created_at: float
    expires_at: float

    def suffix(self, start: int) -> HandoffEntry:
        """The same hand-off, from prompt token ``start`` on (views, no copy)."""
        if start == 0:
            return self
        return dataclasses.replace(
            self, header={**self.header, "start_token": start},
            layers=[(k[:, :, start:], v[:, :, start:]) for k, v in self.layers])

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                   for k, v in self.layers)


@dataclasses.dataclass
class HandoffStats:
    registered: int = 0
    claimed: int = 0
    expired: int = 0
    released: int = 0
    bytes_sent: int = 0
    tokens_skipped: int = 0  # prompt tokens the decode pods already held (not sent)


class HandoffRegistry:
    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self._clock = clock
        self._entries: dict[str, HandoffEntry] = {}
        self._lock = threading.Lock()
        self.stats = HandoffStats()

    def register(self, header: dict[str, Any],
                 layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> str:
        transfer_id = uuid.uuid4().hex
        now = self._clock()
        entry = HandoffEntry(transfer_id, {**header, "transfer_id": transfer_id}, list(layers),
                             now, now + self.timeout_s)
        with self._lock:
            self._entries[transfer_id] = entry
            self.stats.registered += 1
        return transfer_id

    def claim(self, transfer_id: str) -> HandoffEntry | None:
        """Take the entry (once): it is no longer pinned here after this."""
        with self._lock:
            entry = self._entries.pop(transfer_id, None)
            if entry is not None and entry.expires_at <= self._clock():
                self.stats.expired += 1
                return None
            if entry is not None:
                self.stats.claimed += 1
            return entry

    def release(self, transfer_id: str) -> bool:
        with self._lock:
            if self._entries.pop(transfer_id, None) is None:
                return False
            self.stats.released += 1
            return True

    def expire(self) -> list[str]:
        """Release entries nobody claimed in time; returns their ids."""
        now = self._clock()
        with self._lock:
            gone = [t for t, e in self._entries.items() if e.expires_at <= now]
            for t in gone:
                del self._entries[t]
            self.stats.expired += len(gone)
        for t in gone:
            log.info("kv_handoff_expired", transfer_id=t)
        return gone

    def note_skipped(self, tokens: int) -> None:
        with self._lock:
            self.stats.tokens_skipped += tokens

    def pending(self) -> int:
        with self._lock:
            return len(self._entries)

    def pending_bytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def stream(self, entry: HandoffEntry) -> Iterator[bytes]:
        for frame in wire.encode(entry.header, entry.layers):
            with self._lock:
                self.stats.bytes_sent += len(frame)
            yield frame


def handoff_router(registry: HandoffRegistry) -> APIRouter:
    router = APIRouter(prefix="/v1/kv", tags=["kv-handoff"])

    @router.get("/{transfer_id}", summary="Pull (once) the KV a prefill kept for this transfer.",
                response_class=StreamingResponse, responses={
                    200: {"description": "The KV frames (agentserving's hand-off wire format).",
                          "content": {"application/octet-stream": {}}},
                    **error_responses(400, 404)})
    def pull(transfer_id: str, start: int = Query(
            0, ge=0, description="First prompt token to send (the puller holds the ones "
                                 "before)")) -> StreamingResponse:
        entry = registry.claim(transfer_id)
        if entry is None:
            raise ApiError(404, f"unknown or expired transfer '{transfer_id}'",
                           param="transfer_id", type="not_found_error")
        total = int(entry.header["num_tokens"])
        if start > total:
            raise ApiError(400, f"start {start} is past the prompt's {total} tokens",
                           param="start")
        entry = entry.suffix(start)
        registry.note_skipped(start)
        return StreamingResponse(registry.stream(entry), media_type="application/octet-stream",
                                 headers={"x-kv-bytes": str(entry.nbytes)})

    @router.delete("/{transfer_id}", status_code=204, response_class=Response,
                   responses=error_responses(404),
                   summary="Release a transfer's pinned KV without pulling it.")
    def release(transfer_id: str) -> Response:
        if not registry.release(transfer_id):
            raise ApiError(404, f"unknown or expired transfer '{transfer_id}'",
                           param="transfer_id", type="not_found_error")
        return Response(status_code=204)

    return router
