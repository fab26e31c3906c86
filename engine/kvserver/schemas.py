"""The KV server's HTTP bodies. Its evict takes the pods' memory-API body
(``core.schemas.MemoryEvictRequest``) unchanged, so the kvindex's and the pods' eviction
fan-outs reach it with the calls they already make."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, BeforeValidator, Field

from agentserving.core.schemas import ChunkHash, HttpUrlStr, MemoryEvictResponse, Strict

MAX_PULL_TIMEOUT_S = 600.0


def _wire_number(value: object) -> object:
    """JSON's number, as its schema means it: never "5" nor true."""
    if isinstance(value, str | bool):
        raise ValueError("expected a number")
    return value


PullTimeout = Annotated[float | None, Field(gt=0, le=MAX_PULL_TIMEOUT_S),
                        BeforeValidator(_wire_number)]


class KvEvictResult(MemoryEvictResponse):
    """The memory API's evict answer (``num_evicted``: chunks that held a key), plus what it
    freed and the chunks it did not hold."""

    num_missing: int = Field(description="Chunks not held.")
    missing: list[str]
    num_keys: int = Field(description="LMCache keys removed (a chunk may hold several).")
    freed_bytes: int = Field(description="Payload bytes freed.")


class ExportRequest(Strict):
    chunk_hashes: list[ChunkHash]


class PullRequest(Strict):
    source: HttpUrlStr = Field(description="The HTTP API of the KV server holding the chunks, "
                               "e.g. http://prefill-0:65433.")
    chunk_hashes: list[ChunkHash]
    timeout_s: PullTimeout = Field(default=None, description="Seconds the whole pull may take "
                                   "(default: the server's --pull-timeout).")


class PullResult(BaseModel):
    pulled_chunks: int = Field(description="Chunks of which at least one key arrived.")
    pulled_keys: int
    pulled_bytes: int
    already_held: list[str] = Field(default_factory=list,
                                    description="Chunks held here already: not fetched again.")
    missing: list[str] = Field(description="Chunks the source did not have.")
    seconds: float


class ChunkInfo(BaseModel):
    chunk_hash: str
    keys: list[str]
    bytes: int
    pinned: bool = Field(description="Pinned now: passed over by the LRU within the pin share.")


class ChunkListing(BaseModel):
    total_chunks: int
    offset: int
    chunks: list[ChunkInfo] = Field(description="Sorted by chunk hash.")
    used_bytes: int
    capacity_bytes: int
    pinned_chunks: int = Field(description="Chunks pinned now (of all held, not of the page).")
    pinned_bytes: int
