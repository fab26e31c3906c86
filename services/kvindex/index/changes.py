"""The residency change feed: what the index applied, in order, for followers to replay.

A follower (the proxy's in-process replica, ``agentserving.proxy.residency_replica``) lists the
whole residency once, with the feed's cursor taken before the listing, then reads the changes
after that cursor, as a Kubernetes informer lists then watches from a resourceVersion. Changes
are set operations on a pod's (chunk -> tier mask) map, applied in each pod's order, so
replaying some that the listing already holds converges to the same state.

A feed keeps a bounded tail of changes. A cursor older than the tail, or one the feed never
issued (a restarted in-memory kvindex, a Redis whose stream was lost), raises
``CursorExpired`` (HTTP 410), and the follower lists again.

Two backends with one contract (``tests/test_changes.py`` runs against both): the in-process
one for a single kvindex with the memory store, and a Redis stream that every kvindex replica
sharing the store appends to and reads from, so a follower of any replica sees the changes
applied through all of them.
"""

from __future__ import annotations

import asyncio
import collections
import secrets
from typing import Any, Protocol, runtime_checkable

from agentserving.core.schemas import ResidencyChange
from agentserving.kvindex.index.base import KvIndexError
from agentserving.kvindex.index.redis import RedisBackend


class CursorExpired(KvIndexError):
    """The cursor is older than the feed's tail or unknown to it: list again."""


@runtime_checkable
class ChangeFeed(Protocol):
    async def head(self) -> str:
        """The cursor after the newest change: a listing taken after this call holds every
        change up to it."""
        ...

    async def append(self, changes: list[ResidencyChange]) -> None: ...

    async def read(self, after: str, limit: int, wait_s: float
                   ) -> tuple[list[ResidencyChange], str]:
        """Up to ``limit`` changes after ``after`` and the cursor after them; with none yet,
        wait up to ``wait_s`` for one. ``CursorExpired``: a cursor this feed did not issue
        (another kind of feed's too) or no longer keeps."""
        ...

    async def ping(self) -> None:
        """Raise ``BackendUnavailable`` when the feed's store cannot be reached."""
        ...

    async def close(self) -> None: ...


class MemoryChangeFeed:
    """The feed of one in-process kvindex. Cursors are ``<epoch>:<n>``; the epoch is new each
    process, so a follower of a restarted kvindex (its residency gone) lists again."""

    def __init__(self, max_changes: int = 10_000) -> None:
        self._epoch = secrets.token_hex(4)
        self._tail: collections.deque[ResidencyChange] = collections.deque(maxlen=max_changes)
        self._last = 0  # number of the newest change; the tail holds (last - len, last]
        self._appended: asyncio.Event | None = None

    def _cursor(self, n: int) -> str:
        return f"{self._epoch}:{n}"

    async def head(self) -> str:
        return self._cursor(self._last)

    async def append(self, changes: list[ResidencyChange]) -> None:
        self._tail.extend(changes)
        self._last += len(changes)
        if self._appended is not None:
            self._appended.set()
            self._appended = None

    async def read(self, after: str, limit: int, wait_s: float
                   ) -> tuple[list[ResidencyChange], str]:
        epoch, sep, number = after.partition(":")
        n = int(number) if sep and number.isdigit() else -1
        if epoch != self._epoch or not 0 <= n <= self._last:
            raise CursorExpired(f"cursor '{after}' was not issued by this kvindex process")
        if n == self._last and wait_s > 0:
            if self._appended is None:
                self._appended = asyncio.Event()
            try:
                await asyncio.wait_for(self._appended.wait(), wait_s)
            except TimeoutError:
                return [], after
        first = self._last - len(self._tail)  # number of the change before the tail's first
        if n < first:
            raise CursorExpired(f"cursor '{after}' is older than the {len(self._tail)} "
                                f"changes this kvindex keeps")
        start = n - first
        out = [self._tail[i] for i in range(start, min(start + limit, len(self._tail)))]
        return out, self._cursor(n + len(out))

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None


def _stream_id(value: str) -> tuple[int, int]:
    ms, sep, seq = value.partition("-")
    if not sep or not ms.isdigit() or not seq.isdigit():
        raise CursorExpired(f"cursor '{value}' is not a stream id of this kvindex's feed "
                            f"(<ms>-<seq>)")
    return int(ms), int(seq)


class RedisChangeFeed(RedisBackend):
    """The feed as one Redis stream (``<prefix>residency``), trimmed to about ``max_changes``.

    The stream is appended after the index's own write, not inside its script: a change whose
    append failed (Redis down between the two) is missing from the feed, which is why
    followers also list again periodically. Cursors are stream ids; one is expired when it lies
    before the oldest entry of a stream that was trimmed, or beyond the stream's newest id (a
    stream lost with a Redis that kept no copy of it)."""

    def __init__(self, url: str, *, max_changes: int = 10_000, **options: Any) -> None:
        super().__init__(url, **options)
        self._key = self._prefix + "residency"
        self._max_changes = max_changes

    async def _info(self) -> tuple[tuple[int, int], tuple[int, int] | None]:
        """(newest id issued, oldest id kept if the stream was ever trimmed, else None);
        ((0, 0), None) when the stream does not exist."""
        async def info() -> dict[str, Any] | None:
            if not await self._redis.exists(self._key):
                return None
            return await self._redis.xinfo_stream(self._key)

        got = await self._guard(info)
        if got is None:
            return (0, 0), None
        trimmed = int(got["entries-added"]) > int(got["length"])  # the feed never XDELs
        first = got.get("first-entry")
        return (_stream_id(got["last-generated-id"]),
                _stream_id(first[0]) if trimmed and first else None)

    async def head(self) -> str:
        last, _ = await self._info()
        return f"{last[0]}-{last[1]}"

    async def append(self, changes: list[ResidencyChange]) -> None:
        async def xadd() -> None:
            async with self._redis.pipeline(transaction=False) as pipe:
                for change in changes:
                    pipe.xadd(self._key, {"c": change.model_dump_json(exclude_none=True)},
                              maxlen=self._max_changes, approximate=True)
                await pipe.execute()

        if changes:
            await self._guard(xadd)

    async def read(self, after: str, limit: int, wait_s: float
                   ) -> tuple[list[ResidencyChange], str]:
        cursor = _stream_id(after)
        last, kept_from = await self._info()
        # before the oldest kept entry of a trimmed stream: what followed it may be gone (the
        # cursor's own entry may be the last trimmed one: a relist too many, never one short)
        if cursor > last or (kept_from is not None and cursor < kept_from):
            raise CursorExpired(f"cursor '{after}' is not in this kvindex's change stream "
                                f"(newest {last[0]}-{last[1]}, oldest kept "
                                f"{kept_from[0] if kept_from else 0}-"
                                f"{kept_from[1] if kept_from else 0})")
        # a blocking read holds its connection: keep it inside the op timeout
        block_ms = int(min(wait_s, self._op_timeout_s / 2) * 1000)
        got = await self._guard(lambda: self._redis.xread(
            {self._key: after}, count=limit, block=block_ms or None))
        entries = got[0][1] if got else []
        if not entries:
            return [], after
        return ([ResidencyChange.model_validate_json(fields["c"]) for _, fields in entries],
                entries[-1][0])
