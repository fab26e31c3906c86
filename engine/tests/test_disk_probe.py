"""The disk tier's read cost: chunk sizes from a model's config, O_DIRECT vs page-cache reads
on this machine's real filesystem."""

from __future__ import annotations

import json

import pytest

from agentserving.engine.kv.disk_probe import (
    direct_io_error,
    kv_chunk_bytes,
    measure_reads,
    model_chunk_bytes,
)
from agentserving.engine.model.loader import TINY_CONFIG


def test_a_chunk_is_k_and_v_of_every_layer() -> None:
    # the tiny model: 4 layers x 4 KV heads x 64 dims, fp32 (8 KiB a token), 256 tokens: 2 MiB
    assert kv_chunk_bytes(dict(TINY_CONFIG), 256) == 2 * 4 * 256 * 4 * 64 * 4 == 2 << 20
    gqa = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "hidden_size": 576}
    assert kv_chunk_bytes(gqa, 256, "bfloat16") == 2 * 30 * 256 * 3 * 64 * 2


def test_the_chunk_size_comes_from_the_model_folder(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    assert model_chunk_bytes(tmp_path, 128) == 1 << 20


def test_reads_are_timed_per_chunk_and_the_files_removed(tmp_path) -> None:
    buffered = measure_reads(tmp_path, 100_000, chunks=4, io="buffered")
    assert buffered.chunk_bytes == 102_400  # whole pages
    assert buffered.chunks == 4 and buffered.read_gbps > 0
    assert 0 < buffered.read_p50_ms <= buffered.read_p95_ms
    assert not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="io"):
        measure_reads(tmp_path, 4096, io="mmap")


def test_direct_reads_work_where_the_filesystem_allows_them(tmp_path) -> None:
    if (why := direct_io_error(tmp_path)) is not None:
        pytest.skip(why)
    direct = measure_reads(tmp_path, 1 << 20, chunks=4, io="direct")
    assert direct.io == "direct" and direct.read_gbps > 0 and not list(tmp_path.iterdir())
