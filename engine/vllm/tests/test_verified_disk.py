"""LMCache's real disk tier with every chunk checked before use (``verified_disk``): a chunk
deleted, truncated or corrupted under it is not served; the retrieve stops before it (what
vLLM then recomputes), the chunk leaves the tier, and the fallback is counted by cause. A
chunk left alone comes back bit-identical."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from agentserving.engine.vllm import verified_disk
from agentserving.engine.vllm.fallbacks import FALLBACKS

from .conftest import CHUNK, random_kv, until


@pytest.fixture(autouse=True, scope="module")
def checked_disk_reads():
    """The checks on LMCache's class for this module only: the reference engine's store, in
    the same test process, keeps LMCache's own reads (and its own checksums)."""
    verified_disk.install()
    yield
    verified_disk.uninstall()


def fallbacks(cause: str) -> float:
    return FALLBACKS.labels(cause)._value.get()


def only_on_disk(engine: Any, tokens: torch.Tensor) -> list[Path]:
    """Wait for the chunks' disk writes, drop them from DRAM; their files, in chunk order."""
    disk = engine.storage_manager.storage_backends["LocalDiskBackend"]
    cpu = engine.storage_manager.storage_backends["LocalCPUBackend"]
    keys = [key for _, _, key in engine.token_database.process_tokens(tokens)]
    until(lambda: all(disk.contains(k) for k in keys), what="LMCache's disk writes")
    for key in keys:
        cpu.remove(key)
    return [Path(disk.dict[k].path) for k in keys]


@pytest.mark.parametrize(("harm", "cause"), [
    (lambda p: p.unlink(), "disk_missing"),
    (lambda p: os.truncate(p, p.stat().st_size // 2), "disk_truncated"),
    (lambda p: p.write_bytes(bytes([p.read_bytes()[0] ^ 0xFF]) + p.read_bytes()[1:]),
     "disk_corrupt"),
])
def test_a_harmed_disk_chunk_is_not_served_and_the_retrieve_stops_before_it(engines, harm,
                                                                             cause):
    engine = engines()
    tokens = torch.arange(3 * CHUNK)
    kv = random_kv(len(tokens), seed=5)
    engine.store(tokens, kv=kv)
    files = only_on_disk(engine, tokens)
    harm(files[1])
    before = fallbacks(cause)
    out = torch.zeros_like(kv)
    mask = engine.retrieve(tokens, out=out)
    assert int(mask.sum()) == CHUNK  # the first chunk only: the rest is recomputed
    assert torch.equal(out[:, :, :CHUNK], kv[:, :, :CHUNK])  # what was served is exact
    assert fallbacks(cause) == before + 1
    disk = engine.storage_manager.storage_backends["LocalDiskBackend"]
    assert str(files[1]) not in {m.path for m in disk.dict.values()}  # out of the tier
    assert not files[1].exists()


def test_untouched_disk_chunks_come_back_bit_identical_through_both_reads(engines):
    engine = engines()
    tokens = torch.arange(2 * CHUNK)
    kv = random_kv(len(tokens), seed=6)
    engine.store(tokens, kv=kv)
    only_on_disk(engine, tokens)
    before = {c: fallbacks(c) for c in ("disk_missing", "disk_truncated", "disk_corrupt")}
    out = torch.zeros_like(kv)
    assert int(engine.retrieve(tokens, out=out).sum()) == len(tokens)
    assert torch.equal(out, kv)
    # the single-key read (the memory API's prefetch uses it): the same check, the same bytes
    disk = engine.storage_manager.storage_backends["LocalDiskBackend"]
    key = next(k for _, _, k in engine.token_database.process_tokens(tokens))
    obj = disk.get_blocking(key)
    assert obj is not None and torch.equal(obj.tensor, kv[:, :, :CHUNK].to(obj.tensor.dtype))
    obj.ref_count_down()
    Path(disk.dict[key].path).unlink()
    assert disk.get_blocking(key) is None and key not in disk.dict
    assert fallbacks("disk_missing") == before["disk_missing"] + 1
    assert {c: fallbacks(c) for c in ("disk_truncated", "disk_corrupt")} == {
        c: before[c] for c in ("disk_truncated", "disk_corrupt")}


def test_check_read_names_each_cause(tmp_path):
    records = verified_disk.ChunkRecords()
    path = tmp_path / "chunk"
    data = bytes(range(256)) * 4
    path.write_bytes(data)
    records.record(str(path), data)
    buf = bytearray(len(data))

    def read() -> None:
        buf[:] = path.read_bytes()

    verified_disk.check_read(records, str(path), buf, read)
    assert bytes(buf) == data
    path.write_bytes(data[:-1] + b"\x00")
    with pytest.raises(verified_disk.DiskChunkInvalid) as bad:
        verified_disk.check_read(records, str(path), buf, read)
    assert bad.value.cause == "disk_corrupt"
    records.forget(str(path))  # written before this process: the size alone is checked
    verified_disk.check_read(records, str(path), buf, read)
    with pytest.raises(verified_disk.DiskChunkInvalid) as short:
        verified_disk.check_read(records, str(path), bytearray(len(data) + 1), read)
    assert short.value.cause == "disk_truncated"
    path.unlink()
    with pytest.raises(verified_disk.DiskChunkInvalid) as gone:
        verified_disk.check_read(records, str(path), buf, read)
    assert gone.value.cause == "disk_missing"
