"""A tenant's ``cache_salt`` in LMCache's chunk hashes, so tenants never share or probe chunks.

vLLM honours a request's ``cache_salt`` in its own prefix cache, but LMCache 0.5.6 ignores it:
two tenants sending the same prompt would share LMCache chunks (and the kvindex would list one
tenant's chunks under the other's hashes). Two pieces close that:

- ``CacheSaltMiddleware`` (vLLM's API server, ``--middleware``): copies the body's
  ``cache_salt`` into ``kv_transfer_params[SALT_KEY]``. vLLM hands ``kv_transfer_params``
  entries named ``lmcache.*`` to LMCache as the request's configs, in the scheduler process
  (lookup) and in the worker processes (store, retrieve). It copies the caller's
  ``x-agentserving-tenant`` header too (``TENANT_KEY``): the reuse metrics' tenant (``reuse``).
- ``install()`` (every process that builds the connector): LMCache's token database starts the
  chunk-hash chain of a request with that config from the salted start of
  ``agentserving.core.hashing`` (the DESIGN's rule: the salt is mixed into h_0), so every
  chunk hash of a salted prompt differs from the unsalted one and from every other tenant's,
  and ``agentserving chunk-hashes --salt S --scheme lmcache-builtin`` computes the same.

Exercised for real: two tenants' identical prompts on a ``vllm serve`` (e2e/vllm).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from typing import Any

from agentserving.core.hashing import HashScheme, salted_start
from agentserving.core.schemas import TENANT_HEADER
from agentserving.engine.vllm.request_body import JsonBodyMiddleware, Scope, header

SALT_KEY = "lmcache.agentserving_cache_salt"
# the caller's tenant (TENANT_HEADER), for the reuse metrics' tenant label only (``reuse``):
# an ``lmcache.`` key that is no ``lmcache.tag.``, so it never reaches a chunk's key
TENANT_KEY = "lmcache.agentserving_tenant"
_TENANT_HEADER = TENANT_HEADER.encode()

_init_hash: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "agentserving_lmcache_init_hash", default=None)


def salted_body(body: Any, tenant: str | None = None) -> Any | None:
    """The request body with its ``cache_salt`` (and the caller's ``tenant``, from
    ``TENANT_HEADER``) copied for LMCache; None when unchanged."""
    if not isinstance(body, dict):
        return None
    salt = body.get("cache_salt")
    added = {}
    if isinstance(salt, str) and salt:
        added[SALT_KEY] = salt
    if tenant:
        added[TENANT_KEY] = tenant
    if not added:
        return None
    params = body.get("kv_transfer_params")
    if params is not None and not isinstance(params, dict):
        return None  # vLLM rejects it with its own 400
    return {**body, "kv_transfer_params": {**(params or {}), **added}}


def salt_of(request_configs: Any) -> str | None:
    if not isinstance(request_configs, dict):
        return None
    salt = request_configs.get(SALT_KEY)
    return salt if isinstance(salt, str) and salt else None


class CacheSaltMiddleware(JsonBodyMiddleware):
    def rewrite(self, body: Any, scope: Scope) -> Any | None:
        return salted_body(body, header(scope, _TENANT_HEADER))


def install() -> None:
    """Make LMCache's ``ChunkedTokenDatabase`` start a salted request's chain from its salted
    start (once per process)."""
    from lmcache.v1.token_database import ChunkedTokenDatabase

    if getattr(ChunkedTokenDatabase, "_agentserving_salted", False):
        return
    process_tokens = ChunkedTokenDatabase.process_tokens
    get_init_hash = ChunkedTokenDatabase._get_init_hash

    def _salted_init_hash(self: Any) -> int:
        start = _init_hash.get()
        return get_init_hash(self) if start is None else start

    def _process_tokens(self: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        configs = kwargs.get("request_configs", args[5] if len(args) > 5 else None)
        salt = salt_of(configs)
        if salt is None:
            yield from process_tokens(self, *args, **kwargs)
            return
        start = salted_start(HashScheme.LMCACHE_BUILTIN, salt, get_init_hash(self))
        # the chain is computed lazily, inside this generator: the start is set around each
        # step only, never while the caller runs
        inner = process_tokens(self, *args, **kwargs)
        while True:
            token = _init_hash.set(int(start))
            try:
                item = next(inner)
            except StopIteration:
                return
            finally:
                _init_hash.reset(token)
            yield item

    ChunkedTokenDatabase.process_tokens = _process_tokens  # type: ignore[method-assign]
    ChunkedTokenDatabase._get_init_hash = _salted_init_hash  # type: ignore[method-assign]
    ChunkedTokenDatabase._agentserving_salted = True  # type: ignore[attr-defined]
    _salt_lookups(get_init_hash)


def _salt_lookups(get_init_hash: Callable[[Any], int]) -> None:
    """LMCache's scheduler-side lookup clients hash the prompt without the request's configs
    (then send the hashes with them): hash a salted request's prompt from its salted start."""
    from lmcache.v1.lookup_client import lmcache_async_lookup_client, lmcache_lookup_client

    for cls in (lmcache_lookup_client.LMCacheLookupClient,
                lmcache_async_lookup_client.LMCacheAsyncLookupClient):
        lookup = cls.lookup

        def _lookup(self: Any, token_ids: Any, lookup_id: str, request_configs: Any = None,
                    *args: Any, _lookup: Any = lookup, **kwargs: Any) -> Any:
            salt = salt_of(request_configs)
            if salt is None:
                return _lookup(self, token_ids, lookup_id, request_configs, *args, **kwargs)
            start = salted_start(HashScheme.LMCACHE_BUILTIN, salt,
                                 get_init_hash(self.token_database))
            token = _init_hash.set(int(start))
            try:
                return _lookup(self, token_ids, lookup_id, request_configs, *args, **kwargs)
            finally:
                _init_hash.reset(token)

        cls.lookup = _lookup  # type: ignore[method-assign]
