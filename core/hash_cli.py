"""`agentserving chunk-hashes`: print the chunk hashes of a token list, to debug cache misses."""

from __future__ import annotations

import json
import sys

import click

from agentserving.core.cli import option
from agentserving.core.hashing import DEFAULT_CHUNK_SIZE, ChunkHasher, HashScheme


@click.command("chunk-hashes")
@option("--scheme", type=click.Choice([s.value for s in HashScheme]), default="blake3",
        help="Hash scheme of the deployment (see DESIGN.md, chunk_hash).")
@option("--chunk-size", type=click.IntRange(min=1), default=DEFAULT_CHUNK_SIZE,
        help="Tokens per KV chunk.")
@option("--salt", default=None, help="Tenant cache_salt mixed into the first hash.")
@option("--partial/--full-only", default=False,
        help="Also hash a trailing partial chunk (LMCache's save_unfull_chunk).")
@option("--none-hash", type=int, default=0,
        help="Chain start of the builtin schemes (vLLM's NONE_HASH when vLLM is loaded).")
def command(scheme: str, chunk_size: int, salt: str | None, partial: bool, none_hash: int) -> None:
    """Read a JSON list of token ids on stdin; print one hex chunk hash per line."""
    try:
        tokens = json.load(sys.stdin)
    except json.JSONDecodeError as exc:
        raise click.UsageError(f"stdin: not JSON ({exc})") from exc
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in tokens
    ):
        raise click.UsageError("stdin: expected a JSON list of token ids (integers 0..2^32-1)")
    hasher = ChunkHasher(scheme, chunk_size, cache_salt=salt, full_chunks_only=not partial,
                         none_hash=none_hash)
    for h in hasher.hashes(tokens):
        click.echo(h)
