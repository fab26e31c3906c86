"""Picks the kvindex backends named by the ``store`` setting: ``memory`` or a Redis URL."""

from __future__ import annotations

from typing import Any

from agentserving.kvindex.index.base import Index, SessionStore

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
