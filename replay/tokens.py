"""Deterministic token ids for traces that carry no text.

Traces name their content instead of spelling it: a shared block by its id, a turn's own new
tokens by (session, turn, purpose). This module turns those names into token ids, the same ids
in every process, on every machine and with every library version: the ids are read from the
BLAKE3 extendable output of the name (big-endian u32 words, reduced into the vocabulary), not
from a seeded pseudo-random generator whose stream could change between releases.

- ``block_tokens(block_id, n)``: the first ``n`` tokens of a shared block. The same id always
  gives the same tokens (an int id and its decimal string name the same block), and a block
  trimmed to ``n`` tokens is a prefix of the untrimmed block.
- ``unique_tokens(key, n)``: tokens that belong to one place in one trace (a tool result, a
  forced output); different keys give unrelated tokens.

Token ids fall in ``[FIRST_TOKEN_ID, vocab_size)``: the ids below 16 are left out because
tokenizers put their special tokens there (BOS, EOS, PAD), and a forced output must never
contain an end-of-sequence token.
"""

from __future__ import annotations

from functools import lru_cache

import blake3
import numpy as np

FIRST_TOKEN_ID = 16
DEFAULT_VOCAB_SIZE = 32000


def _stream(name: str, n: int, vocab_size: int) -> np.ndarray:
    if vocab_size <= FIRST_TOKEN_ID:
        raise ValueError(f"vocab_size must exceed {FIRST_TOKEN_ID}, got {vocab_size}")
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    words = np.frombuffer(blake3.blake3(name.encode()).digest(length=4 * n), dtype=">u4")
    return (words.astype(np.int64) % (vocab_size - FIRST_TOKEN_ID)) + FIRST_TOKEN_ID


@lru_cache(maxsize=8192)
def _block(block_id: str, size: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(_stream(f"agentserving.replay/block/{block_id}", size, vocab_size).tolist())


def block_tokens(block_id: int | str, n: int, *, block_size: int,
                 vocab_size: int = DEFAULT_VOCAB_SIZE) -> list[int]:
    """The first ``n`` (<= ``block_size``) tokens of shared block ``block_id``."""
    if not 0 <= n <= block_size:
        raise ValueError(f"a block holds at most {block_size} tokens, asked for {n}")
    return list(_block(str(block_id), block_size, vocab_size)[:n])


def unique_tokens(key: str, n: int, *, vocab_size: int = DEFAULT_VOCAB_SIZE) -> list[int]:
    """``n`` tokens named by ``key`` (e.g. ``"input/s7/3"``), unrelated to any other key."""
    return _stream(f"agentserving.replay/unique/{key}", n, vocab_size).tolist()
