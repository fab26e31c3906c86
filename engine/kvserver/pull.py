"""Pull chunks from another KV server into this one: ``POST {source}/v1/export`` streamed,
each record stored as it completes.

Chunks already held here are not asked for. What the source lacks is reported missing, not an
error. A source that cannot be reached, answers with an error, sends something that is no
export stream or cuts it short is a ``PullFailed`` (502; 504 when the time is up); the records
that arrived whole before that stay stored -- each is a blob exactly as LMCache PUT it on the
source -- and nothing partial is ever stored.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from agentserving.engine.kvserver.metrics import KvServerMetrics
from agentserving.engine.kvserver.records import RecordError, RecordReader
from agentserving.engine.kvserver.store import BlobStore


class PullFailed(Exception):
    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message


@dataclass
class PullOutcome:
    already_held: list[str]
    missing: list[str] = field(default_factory=list)
    chunks: set[str] = field(default_factory=set)
    keys: int = 0
    bytes: int = 0
    seconds: float = 0.0


async def pull(http: httpx.AsyncClient, store: BlobStore, metrics: KvServerMetrics,
               source: str, chunk_hashes: Sequence[str], timeout_s: float) -> PullOutcome:
    started = time.monotonic()
    wanted = list(dict.fromkeys(chunk_hashes))
    todo = [c for c in wanted if not store.has_chunk(c)]
    out = PullOutcome(already_held=[c for c in wanted if store.has_chunk(c)])
    outcome = "ok"
    try:
        if todo:
            async with asyncio.timeout(timeout_s):
                await _fetch(http, store, metrics, source, todo, out)
        out.missing = [c for c in todo if c not in out.chunks]
        return out
    except PullFailed:
        outcome = "failed"
        raise
    except TimeoutError as exc:
        outcome = "timeout"
        raise PullFailed(504, f"source {source} did not send the chunks within {timeout_s:g} "
                         f"s ({out.keys} keys stored before that)") from exc
    except httpx.HTTPError as exc:
        outcome = "failed"
        raise PullFailed(502, f"source {source} unreachable: {type(exc).__name__}: {exc}"
                         ) from exc
    finally:
        out.seconds = time.monotonic() - started
        metrics.pull_seconds.labels(outcome).observe(out.seconds)


async def _fetch(http: httpx.AsyncClient, store: BlobStore, metrics: KvServerMetrics,
                 source: str, todo: list[str], out: PullOutcome) -> None:
    asked = set(todo)
    reader = RecordReader()
    async with http.stream("POST", f"{source}/v1/export", json={"chunk_hashes": todo}) as resp:
        if resp.status_code != 200:
            body = (await resp.aread())[:300].decode(errors="replace")
            raise PullFailed(502, f"source {source} answered {resp.status_code} to its export: "
                             f"{body}")
        try:
            async for piece in resp.aiter_bytes():
                for blob in reader.feed(piece):
                    if blob.chunk not in asked:
                        continue  # never store what was not asked for
                    metrics.put(store.put(blob), blob.length)
                    out.chunks.add(blob.chunk)
                    out.keys += 1
                    out.bytes += blob.length
                    metrics.pull_keys.inc()
                    metrics.pull_bytes.inc(blob.length)
        except RecordError as exc:
            raise PullFailed(502, f"source {source} sent a bad export stream: {exc}") from exc
    if not reader.done:
        raise PullFailed(502, f"source {source} cut its export stream short "
                         f"({out.keys} whole keys stored)")
