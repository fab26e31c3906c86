"""Request checks beyond the schemas: size limits that depend on settings."""

from __future__ import annotations

from agentserving.core.schemas import ChunkSnapshot, EventBatch
from agentserving.core.service import ApiError


def check_batch_size(batch: EventBatch, limit: int) -> int:
    total = sum(len(e.chunk_hashes) for e in batch.events)
    if total > limit:
        raise ApiError(413, f"batch holds {total} chunk events, over the limit of {limit}; "
                       "split it", param="events")
    return total


def check_snapshot_size(snap: ChunkSnapshot, limit: int) -> None:
    total = sum(len(c) for c in snap.chunks.values())
    if total > limit:
        raise ApiError(413, f"snapshot holds {total} chunks, over the limit of {limit}",
                       param="chunks")


def check_chain_size(chunk_hashes: list[str], limit: int, param: str = "chunk_hashes") -> None:
    if len(chunk_hashes) > limit:
        raise ApiError(413, f"{len(chunk_hashes)} chunk hashes, over the limit of {limit}",
                       param=param)
