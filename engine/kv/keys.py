"""One chunk id, three spellings: the wire hex (``core.hashing``), LMCache's int
``CacheEngineKey.chunk_hash``, and the ``CacheEngineKey`` itself.

LMCache keys its tiers by ``CacheEngineKey(model, world_size, worker_id, chunk_hash: int,
dtype)``. We feed it *our* chain (``core.hashing.ChunkHasher``) instead of its own: the
``ChunkTokenDatabase`` below replaces ``ChunkedTokenDatabase``'s hashing, so the key's int is
exactly the wire hash read as an integer — ``int(hex, 16)`` — for every scheme:

- ``lmcache-builtin`` / ``lmcache-ascend``: the int *is* LMCache's own hash (signed), so the
  keys equal stock LMCache's; the wire form is ``f"{h:x}"``.
- ``blake3``: the 32-byte digest as a big-endian unsigned int; the wire form is the
  zero-padded 64-digit hex (``int -> f"{h:064x}"``), so leading zeros survive the round trip.

The memory API therefore needs no map from hex to key: ``key_of(hex)`` rebuilds the key
(seed 000's ``_hashes_to_keys``), and ``wire_of(key)`` renders residency for the kvindex.
A tenant's ``cache_salt`` reaches the token database through LMCache's ``request_configs``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from agentserving.core.hashing import ChunkHasher, HashScheme, is_chunk_hash

SALT_CONFIG_KEY = "agentserving.cache_salt"


class ChunkKeys:
    """Converts between wire hashes, LMCache ints and ``CacheEngineKey``s for one engine."""

    def __init__(self, scheme: HashScheme, chunk_size: int, model_name: str,
                 kv_dtype: torch.dtype, worker_id: int = 0, world_size: int = 1) -> None:
        self.scheme = HashScheme(scheme)
        self.chunk_size = chunk_size
        self.model_name = model_name
        self.kv_dtype = kv_dtype
        self.worker_id = worker_id
        self.world_size = world_size
        self._hashers: dict[str | None, ChunkHasher] = {}

    def hasher(self, cache_salt: str | None = None) -> ChunkHasher:
        hasher = self._hashers.get(cache_salt)
        if hasher is None:
            hasher = ChunkHasher(self.scheme, self.chunk_size, cache_salt=cache_salt)
            if len(self._hashers) < 1024:
                self._hashers[cache_salt] = hasher
        return hasher

    def int_hashes(self, tokens: Any, cache_salt: str | None = None) -> list[int]:
        return [self.to_int(h) for h in self.hasher(cache_salt).raw_hashes(tokens)]

    def wire_hashes(self, tokens: Any, cache_salt: str | None = None) -> list[str]:
        return self.hasher(cache_salt).hashes(tokens)

    @staticmethod
    def to_int(raw: int | bytes) -> int:
        return int.from_bytes(raw, "big") if isinstance(raw, bytes) else raw

    def int_of(self, wire: str) -> int | None:
        """The LMCache int of a wire hash; None if it cannot be one of this scheme's."""
        if not is_chunk_hash(wire):
            return None
        if self.scheme is HashScheme.BLAKE3 and (len(wire) != 64 or wire.startswith("-")):
            return None
        return int(wire, 16)

    def wire_of_int(self, value: int) -> str:
        if self.scheme is HashScheme.BLAKE3:
            return f"{value:064x}"
        return f"{value:x}"

    def key(self, value: int) -> Any:
        from lmcache.utils import CacheEngineKey

        return CacheEngineKey(self.model_name, self.world_size, self.worker_id, value,
                              self.kv_dtype)

    def key_of(self, wire: str) -> Any | None:
        value = self.int_of(wire)
        return None if value is None else self.key(value)

    def wire_of(self, key: Any) -> str:
        return self.wire_of_int(key.chunk_hash)

    def keys(self, values: Iterable[int]) -> list[Any]:
        return [self.key(v) for v in values]


def make_token_database(chunk_keys: ChunkKeys, config: Any, metadata: Any) -> Any:
    """An LMCache ``TokenDatabase`` whose chunk hashes are ``chunk_keys``' chain."""
    from lmcache.v1.token_database import ChunkedTokenDatabase

    class ChunkTokenDatabase(ChunkedTokenDatabase):
        def process_tokens(self, tokens=None, hashes=None, offsets=None, mask=None,
                           make_key=True, request_configs=None):  # type: ignore[no-untyped-def]
            if tokens is None:
                yield from super().process_tokens(tokens, hashes, offsets, mask, make_key,
                                                  request_configs)
                return
            num_falses = 0 if mask is None else int(mask.numel() - mask.long().sum().item())
            if num_falses % self.chunk_size:
                raise ValueError("The number of Falses in the mask is not a multiple of the "
                                 "chunk size.")
            salt = (request_configs or {}).get(SALT_CONFIG_KEY)
            size = self.chunk_size
            for i, value in enumerate(chunk_keys.int_hashes(tokens, salt)):
                start = i * size
                if start < num_falses:
                    continue
                yield start, start + size, (chunk_keys.key(value) if make_key else value)

    return ChunkTokenDatabase(config, metadata)
