"""``device_kv.DeviceKv`` on vLLM's real ``BlockPool`` (the test-only vLLM env, in a child
process): a pinned request's blocks stay out of the free queue under an allocation that takes
every free block, until the TTL; the bound refuses a pin past the pool's share; the context's
next pinned turn replaces the earlier pin; an unpin gives the blocks back, an evict also drops
them from the prefix cache; the device residency lists the chunks whose blocks still hold
their tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from testkit.vllm_env import vllm_env_dir

ENV_DIR = vllm_env_dir()
pytestmark = pytest.mark.skipif(ENV_DIR is None, reason="vLLM test env not installed (run "
                                "scripts/vllm-test-env.sh, which `make test` does)")

CHILD = textwrap.dedent("""
    import json, sys
    from testkit.vllm_env import enter_vllm_env
    enter_vllm_env(sys.argv[1])
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id
    from agentserving.engine.vllm.device_kv import DeviceKv

    class Clock:
        now = 0.0
        def __call__(self):
            return self.now

    BLOCK, CHUNK = 4, 8  # two blocks a chunk
    pool = BlockPool(24, True, hash_block_size=BLOCK)
    clock = Clock()
    kv = DeviceKv(pool, block_size=BLOCK, chunk_tokens=CHUNK, max_blocks=10, clock=clock)
    out = {}

    def finish(rid, n_blocks, salt, ttl, chunks):
        # a request that ran to its end: its full blocks cached, then freed by vLLM
        blocks = pool.get_new_blocks(n_blocks)
        for i, b in enumerate(blocks):
            key = make_block_hash_with_group_id(BlockHash(f"{salt}-{i}".encode()), 0)
            pool._insert_block_hash(key, b, num_tokens=BLOCK)
        kv.finished(rid, blocks, chunks, ttl)
        pool.free_blocks(reversed(blocks))
        return blocks

    def survives_full_allocation(blocks):
        taken = pool.get_new_blocks(pool.get_num_free_blocks())
        ok = not {b.block_id for b in blocks} & {b.block_id for b in taken}
        pool.free_blocks(taken)
        return ok

    pinned = finish("a1", 4, "a", 60.0, ["ca0", "ca1"])
    plain = finish("b1", 4, "b", None, ["cb0", "cb1"])
    out["pinned_blocks"] = kv.pinned_blocks
    out["free_after_pin"] = pool.get_num_free_blocks()
    out["device_chunks"] = sorted(kv.device_chunks())
    out["pinned_survive"] = survives_full_allocation(pinned)
    out["plain_hashes_after"] = [b.block_hash is not None for b in plain]
    out["device_chunks_after_flood"] = sorted(kv.device_chunks())
    # the bound: 4 pinned + 8 more > 10
    finish("c1", 8, "c", 60.0, ["cc0", "cc1", "cc2", "cc3"])
    out["after_refused"] = kv.pinned_blocks
    # the context's next turn (a superset of its chunks) replaces the earlier pin
    nxt = finish("a2", 6, "a2", 60.0, ["ca0", "ca1", "ca2"])
    out["after_next_turn"] = kv.pinned_blocks
    # the TTL lapses at the next schedule()
    clock.now = 61.0
    kv.apply()
    out["after_ttl"] = kv.pinned_blocks
    # a pin released by chunk, and an evict that drops the blocks from the prefix cache
    again = finish("a3", 6, "a3", 60.0, ["ca0", "ca1", "ca2"])
    kv.release(["ca1"], evict=False)
    kv.apply()
    out["after_unpin"] = kv.pinned_blocks
    out["hashed_after_unpin"] = all(b.block_hash is not None for b in again)
    kv.release(["ca0", "ca2"], evict=True)
    kv.apply()
    out["hashed_after_evict"] = [b.block_hash is not None for b in again]
    out["device_chunks_end"] = sorted(kv.device_chunks())
    print(json.dumps(out))
""")


def test_device_kv_on_vllms_block_pool():
    proc = subprocess.run([sys.executable, "-c", CHILD, str(ENV_DIR)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONHASHSEED": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["pinned_blocks"] == 4
    assert out["free_after_pin"] == 24 - 1 - 4  # the null block, and the pinned ones
    assert out["device_chunks"] == ["ca0", "ca1", "cb0", "cb1"]
    assert out["pinned_survive"] is True
    assert out["plain_hashes_after"] == [False] * 4  # taken by the allocation: hashes gone
    assert out["device_chunks_after_flood"] == ["ca0", "ca1"]
    assert out["after_refused"] == 4
    assert out["after_next_turn"] == 6
    assert out["after_ttl"] == 0
    assert out["after_unpin"] == 0 and out["hashed_after_unpin"] is True
    assert out["hashed_after_evict"] == [False, False, True, True, False, False]
    assert "ca1" in out["device_chunks_end"]
    assert not {"ca0", "ca2"} & set(out["device_chunks_end"])
