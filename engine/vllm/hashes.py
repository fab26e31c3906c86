"""Chunk hashes of a request, cached at lookup and returned when it finishes (seed 000 §3).

LMCache's scheduler-side lookup client already hashes every prompt chunk when vLLM asks how
many tokens LMCache holds (``token_database.process_tokens(tokens, make_key=False)``). The
``RecordingTokenDatabase`` wraps that token database and keeps those hashes under the request
id, so ``request_finished`` returns them at no cost (``ChunkHashCache.pop``: taken once, never
leaked). Only when nothing was recorded — the lookup was skipped (a ``kv_producer`` pool asks
no lookup), or LMCache came up degraded — are they recomputed from the prompt with the same
token database. Recording never changes what LMCache sees: the generator yields exactly what
the wrapped one yields.

Wire form: lower-case hex of LMCache's int, sign kept for its builtin (signed 64-bit) hash,
64 digits for wider ints — what the kvindex's LMCache controller adapter renders
(``services/kvindex/ingest/lmcache_controller.render_key``), so both paths name a chunk alike.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from agentserving.core.hashing import render_hash

_BUILTIN_BITS = 64


def wire_hash(value: int | bytes) -> str:
    if isinstance(value, bytes):
        value = int.from_bytes(value, "big")
    if value >= 1 << _BUILTIN_BITS:
        return f"{value:064x}"
    return render_hash(value)


def external_request_id(internal: str) -> str:
    """The id a client sees for a vLLM request: vLLM appends ``-`` and 8 random characters to
    it internally (``InputProcessor.assign_request_id``); completions add ``-<choice index>``
    before that, which stays (the stream's ``id`` + ``-0``)."""
    head, sep, tail = internal.rpartition("-")
    return head if sep and len(tail) == 8 else internal


class ChunkHashCache:
    """request id -> chunk hashes (ints at lookup, wire strings once finished); bounded, the
    oldest dropped first."""

    def __init__(self, max_requests: int = 65536) -> None:
        self.max_requests = max_requests
        self._items: collections.OrderedDict[str, list[Any]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def put(self, request_id: str, hashes: Sequence[Any]) -> None:
        self._store(request_id, list(hashes))

    def _store(self, request_id: str, value: Any) -> None:
        with self._lock:
            self._items[request_id] = value
            self._items.move_to_end(request_id)
            while len(self._items) > self.max_requests:
                self._items.popitem(last=False)

    def pop(self, request_id: str) -> list[Any] | None:
        with self._lock:
            out = self._items.pop(request_id, None)
            if out is None:
                self.misses += 1
            else:
                self.hits += 1
            return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


class FinishedParams(ChunkHashCache):
    """request id -> what a finished request's ``kv_transfer_params`` gained here (chunk
    hashes, prompt sources), kept for its stream's last event (``stream_hashes``)."""

    def put(self, request_id: str, params: dict[str, Any]) -> None:  # type: ignore[override]
        self._store(request_id, params)


class RecordingTokenDatabase:
    """Delegates to an LMCache ``TokenDatabase``; while ``recording(request_id)`` is active on
    this thread, the hashes a ``make_key=False`` pass yields are kept for that request."""

    def __init__(self, inner: Any, cache: ChunkHashCache) -> None:
        self.inner = inner
        self.cache = cache
        self._local = threading.local()

    def __getattr__(self, name: str) -> Any:  # everything else is the real database's
        return getattr(self.inner, name)

    @contextmanager
    def recording(self, request_id: str) -> Iterator[None]:
        self._local.request_id = request_id
        try:
            yield
        finally:
            self._local.request_id = None

    def process_tokens(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        request_id = getattr(self._local, "request_id", None)
        make_key = kwargs.get("make_key", args[4] if len(args) > 4 else True)
        gen = self.inner.process_tokens(*args, **kwargs)
        if request_id is None or make_key:
            yield from gen
            return
        seen: list[int] = []
        for item in gen:
            seen.append(item[2])
            yield item
        self.cache.put(request_id, seen)  # only a pass that ran to the end is kept


def innermost_lookup_client(client: Any) -> Any:
    """LMCache wraps its lookup client in decorators (``HitLimitLookupClient``,
    ``ChunkStatisticsLookupClient``) that keep the real one in ``actual_lookup_client``."""
    seen = 0
    while hasattr(client, "actual_lookup_client") and seen < 16:
        client = client.actual_lookup_client
        seen += 1
    return client


def install_recorder(lookup_client: Any, cache: ChunkHashCache) -> RecordingTokenDatabase | None:
    """Wrap the lookup client's token database (once); None if it has none to wrap."""
    inner = innermost_lookup_client(lookup_client)
    db = getattr(inner, "token_database", None)
    if db is None:
        return None
    if isinstance(db, RecordingTokenDatabase):
        return db
    recorder = RecordingTokenDatabase(db, cache)
    inner.token_database = recorder
    return recorder


def finished_hashes(cached: list[int] | None,
                    recompute: Callable[[], Iterable[int]] | None) -> list[str] | None:
    """The wire hashes to return for a finished request: the cached ones, else recomputed
    (when a way to recompute exists), else None."""
    if cached is None:
        if recompute is None:
            return None
        cached = list(recompute())
    return [wire_hash(h) for h in cached]


def prompt_tokens(request: Any) -> list[int]:
    """The tokens a request was looked up with: its prompt (seed 000 falls back to all)."""
    tokens = getattr(request, "prompt_token_ids", None) or getattr(request, "all_token_ids", None)
    return list(tokens or [])


def print_lmcache_none_hash() -> None:
    """Print the chain start (``NONE_HASH``) LMCache uses beside vLLM in this environment: run
    it in the vLLM env with the pods' ``PYTHONHASHSEED`` (0), then pass the number to
    ``agentserving chunk-hashes --scheme lmcache-builtin --none-hash N``."""
    from agentserving.engine.vllm.launch import alias_vllm_distribution

    alias_vllm_distribution()
    from lmcache.v1 import token_database
    from lmcache.v1.config import LMCacheEngineConfig

    token_database.ChunkedTokenDatabase(LMCacheEngineConfig.from_defaults(), None)
    print(token_database.NONE_HASH)
