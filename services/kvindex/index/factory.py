"""Picks the kvindex backends named by the ``store`` setting: ``memory`` or a Redis URL."""

from __future__ import annotations

from typing import Any

from agentserving.kvindex.index.base import Index, SessionStore
from agentserving.kvindex.index.changes import ChangeFeed

REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "redis+sentinel://")


def new_index(store: str, **redis_options: Any) -> tuple[Index, SessionStore]:
    """``(index, session_store)`` for ``store``.

    ``memory`` gives the in-process backends (one kvindex replica, state lost on restart); a
    ``redis://``, ``rediss://`` or ``unix://`` URL gives the Redis backends, which every replica
    can share, and ``redis+sentinel://host:26379[,host:26379]/service[/db]`` the same on the
    master a set of Sentinels names (failover). ``redis_options`` go to both Redis backends
    (``key_prefix``, timeouts, ``min_acks``).
    """
    if store == "memory":
        from agentserving.kvindex.index.memory import InMemoryIndex, InMemorySessionStore

        return InMemoryIndex(), InMemorySessionStore()
    if store.startswith(REDIS_SCHEMES):
        from agentserving.kvindex.index.redis import RedisIndex, RedisSessionStore

        return RedisIndex(store, **redis_options), RedisSessionStore(store, **redis_options)
    raise ValueError(
        f"store: {store!r} is neither 'memory' nor a Redis URL "
        f"(redis://host:port/db, rediss://..., unix:///path, "
        f"redis+sentinel://host:26379/service/db)"
    )


def new_feed(store: str, max_changes: int, **redis_options: Any) -> ChangeFeed:
    """The residency change feed beside ``new_index(store)``'s backends: in-process for
    ``memory``, a stream in the same Redis (shared by every replica) otherwise."""
    if store == "memory":
        from agentserving.kvindex.index.changes import MemoryChangeFeed

        return MemoryChangeFeed(max_changes)
    from agentserving.kvindex.index.changes import RedisChangeFeed

    return RedisChangeFeed(store, max_changes=max_changes, **redis_options)
