"""chunk_hash: the cluster-wide id of a KV chunk (DESIGN.md, "Contracts").

A prompt's tokens are cut into chunks of ``chunk_size`` tokens and each chunk's hash chains the
previous one, ``h_i = H(h_{i-1}, tokens[i*C:(i+1)*C])``, so one hash names a whole prefix. The
engine computes these and hands them to the proxy and the kvindex, which never tokenize; every
component that compares hashes must therefore agree on the scheme, bit for bit:

- ``blake3``: the chain of LMCache's multiprocess ``TokenHasher``. Stable in every process.
- ``lmcache-builtin``: stock LMCache's ``ChunkedTokenDatabase`` (Python's ``hash`` of
  ``(prev, tokens, ())``); ints and tuples of ints hash the same under any PYTHONHASHSEED.
- ``lmcache-ascend``: LMCache-Ascend's variant, hashing the 2-tuple ``(prev, tokens)``.

A tenant's ``cache_salt`` replaces the chain's start value with one derived from the salt, so
two tenants' chains never meet and neither can probe the other's prefixes.
"""

from __future__ import annotations

import hashlib
import pickle
import sys
from array import array
from collections.abc import Sequence
from enum import StrEnum
from typing import Any

import blake3

DEFAULT_CHUNK_SIZE = 256


class HashScheme(StrEnum):
    BLAKE3 = "blake3"
    LMCACHE_BUILTIN = "lmcache-builtin"
    LMCACHE_ASCEND = "lmcache-ascend"
    # vLLM's own prefix-cache block hashes (its default sha256 over pickle, NONE_HASH from
    # PYTHONHASHSEED=0), rendered as the 64-bit ints its KV events carry: what the kvindex
    # indexes from a plain vLLM pod's events, and what the proxy hashes a prompt with to look
    # them up (precise prefix-cache routing, as llm-d's precise scorer does).
    VLLM_SHA256 = "vllm-sha256"


# The schemes of KV chunks that pods store and hand over (LMCache's, in chunks of chunk_size
# tokens): what a worker, and a deployment's kvCache.hashScheme, may name. VLLM_SHA256 names
# vLLM's own device blocks, which only the proxy and the kvindex see.
CHUNK_HASH_SCHEMES = (HashScheme.BLAKE3, HashScheme.LMCACHE_BUILTIN, HashScheme.LMCACHE_ASCEND)

# The chunk-hash scheme each engine computes natively (LMCache inside vLLM chains Python's
# hash(), LMCache-Ascend its 2-tuple variant): the default wherever an engine is named.
ENGINE_HASH_SCHEMES: dict[str, HashScheme] = {
    "reference": HashScheme.BLAKE3, "vllm": HashScheme.LMCACHE_BUILTIN,
    "vllm-ascend": HashScheme.LMCACHE_ASCEND}


def _pack_u32_be(tokens: Any) -> bytes:
    """Tokens as big-endian u32 bytes (``struct.pack('>%dI')``), without a per-token loop."""
    if hasattr(tokens, "numpy"):  # torch tensor
        tokens = tokens.numpy()
    if hasattr(tokens, "astype"):  # numpy array
        return tokens.astype(">u4", copy=False).tobytes()
    packed = array("I", tokens)
    if sys.byteorder == "little":
        packed.byteswap()
    return packed.tobytes()


def _as_int_list(tokens: Any) -> list[int]:
    if hasattr(tokens, "tolist"):
        return tokens.tolist()
    return list(tokens)


def render_hash(value: int | bytes) -> str:
    """The wire form of a chunk hash: lower-case hex; builtin ints keep their sign."""
    if isinstance(value, bytes):
        return value.hex()
    return f"{value:x}"


def _blake3_none_hash() -> bytes:
    # LMCache's TokenHasher starts the chain from H((0, (0,), None)).
    return blake3.blake3((0).to_bytes(8, "big", signed=True) + _pack_u32_be([0])).digest()


_BLAKE3_NONE_HASH = _blake3_none_hash()


VLLM_HASH_SEED = "0"  # the PYTHONHASHSEED every vLLM pod runs with (serve_command)


def _vllm_sha256(value: Any) -> bytes:
    """vLLM's ``sha256`` prefix-cache hash: SHA-256 of the highest-protocol pickle."""
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def vllm_block_hash_int(digest: bytes) -> int:
    """A vLLM block hash as its KV events carry it (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``):
    the digest's low 64 bits, big-endian."""
    return int.from_bytes(digest, "big") & ((1 << 64) - 1)


def salted_start(scheme: HashScheme, salt: str, none_hash: int) -> int | bytes:
    """The chain's start value for a tenant: deterministic, and never equal to an unsalted one."""
    digest = blake3.blake3(b"agentserving-cache-salt\x00" + salt.encode()).digest()
    if scheme is HashScheme.BLAKE3:
        return blake3.blake3(_BLAKE3_NONE_HASH + digest).digest()
    return hash((none_hash, int.from_bytes(digest[:8], "big", signed=True)))


class ChunkHasher:
    """Turns token ids into the chain of chunk hashes of one deployment's scheme.

    ``none_hash`` is the builtin schemes' chain start: 0 for stock LMCache without vLLM; with
    vLLM loaded, LMCache takes vLLM's ``NONE_HASH`` instead, which the caller must pass here.
    """

    def __init__(
        self,
        scheme: HashScheme | str = HashScheme.BLAKE3,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        *,
        cache_salt: str | None = None,
        full_chunks_only: bool = True,
        none_hash: int = 0,
    ) -> None:
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.scheme = HashScheme(scheme)
        self.chunk_size = chunk_size
        self.cache_salt = cache_salt
        self.full_chunks_only = full_chunks_only
        self.none_hash = none_hash
        if self.scheme is HashScheme.VLLM_SHA256:  # vLLM salts the first block's extra keys
            self._start = _vllm_sha256(VLLM_HASH_SEED)
        elif cache_salt:
            self._start: int | bytes = salted_start(self.scheme, cache_salt, none_hash)
        elif self.scheme is HashScheme.BLAKE3:
            self._start = _BLAKE3_NONE_HASH
        else:
            self._start = none_hash

    def chunk_bounds(self, num_tokens: int) -> list[tuple[int, int]]:
        """(start, end) token offsets of the chunks that get a hash."""
        size = self.chunk_size
        end = num_tokens - num_tokens % size if self.full_chunks_only else num_tokens
        return [(i, min(i + size, num_tokens)) for i in range(0, end, size)]

    def raw_hashes(self, tokens: Sequence[int] | Any) -> list[int | bytes]:
        """The chain as the scheme computes it (bytes for blake3, ints for the builtins)."""
        bounds = self.chunk_bounds(len(tokens))
        if self.scheme is HashScheme.BLAKE3:
            return self._blake3_chain(tokens, bounds)
        if self.scheme is HashScheme.VLLM_SHA256:
            return self._vllm_chain(_as_int_list(tokens), bounds)
        return self._builtin_chain(_as_int_list(tokens), bounds)

    def hashes(self, tokens: Sequence[int] | Any) -> list[str]:
        """The chain in wire form, one hex string per chunk."""
        if self.scheme is HashScheme.VLLM_SHA256:
            return [render_hash(vllm_block_hash_int(h))  # type: ignore[arg-type]
                    for h in self.raw_hashes(tokens)]
        return [render_hash(h) for h in self.raw_hashes(tokens)]

    def _vllm_chain(self, tokens: list[int], bounds: list[tuple[int, int]]
                    ) -> list[int | bytes]:
        """vLLM's ``hash_block_tokens`` chain; a cache salt is the first block's extra key."""
        prev = self._start
        out: list[int | bytes] = []
        for start, end in bounds:
            extra = (self.cache_salt,) if start == 0 and self.cache_salt else None
            prev = _vllm_sha256((prev, tuple(tokens[start:end]), extra))
            out.append(prev)
        return out

    def _blake3_chain(self, tokens: Any, bounds: list[tuple[int, int]]) -> list[int | bytes]:
        data = memoryview(_pack_u32_be(tokens))
        prev = self._start
        out: list[int | bytes] = []
        for start, end in bounds:
            hasher = blake3.blake3(prev)
            hasher.update(data[start * 4 : end * 4])
            prev = hasher.digest()
            out.append(prev)
        return out

    def _builtin_chain(self, tokens: list[int], bounds: list[tuple[int, int]]) -> list[int | bytes]:
        prev = self._start
        out: list[int | bytes] = []
        two_tuple = self.scheme is HashScheme.LMCACHE_ASCEND
        for start, end in bounds:
            chunk = tuple(tokens[start:end])
            prev = hash((prev, chunk)) if two_tuple else hash((prev, chunk, ()))
            out.append(prev)
        return out


def chunk_hashes(
    tokens: Sequence[int] | Any,
    scheme: HashScheme | str = HashScheme.BLAKE3,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    cache_salt: str | None = None,
) -> list[str]:
    """One-shot helper: the hex chunk hashes of ``tokens``."""
    return ChunkHasher(scheme, chunk_size, cache_salt=cache_salt).hashes(tokens)


def is_chunk_hash(value: str) -> bool:
    """Wire-form check: lower-case hex, optionally signed (builtin schemes), at most 64 digits."""
    digits = value[1:] if value.startswith("-") else value
    return 0 < len(digits) <= 64 and all(c in "0123456789abcdef" for c in digits)
