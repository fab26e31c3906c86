"""What a read from the disk tier costs on this machine: bandwidth and latency per KV chunk.

A disk tier read through the page cache is a DRAM copy whenever the machine has memory to
spare, which is why a benchmark with buffered reads shows a "disk" as fast as DRAM and a
prefetch from it as worthless. With ``--disk-io direct`` LMCache opens chunk files with
``O_DIRECT`` and every read costs what the device costs; this module measures that cost the
same way (chunk-sized files, one ``O_DIRECT`` read each into a page-aligned buffer), so the
run's report can name the bandwidth and latency its disk tier had, and the disk-tier bench can
set them beside DRAM copies of the same chunks.
"""

from __future__ import annotations

import json
import mmap
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class DiskReads:
    """Reads of ``chunks`` chunk files of ``chunk_bytes`` each."""

    io: str  # "direct" (O_DIRECT) or "buffered" (through the page cache)
    chunk_bytes: int
    chunks: int
    read_gbps: float  # bytes read / total read time, GB/s
    read_p50_ms: float  # one chunk's read
    read_p95_ms: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def kv_chunk_bytes(config: dict[str, Any], chunk_tokens: int, dtype: str = "float32") -> int:
    """Bytes of one KV chunk (K and V of every layer) of a model with this Hugging Face
    ``config.json``: what LMCache writes to disk per chunk."""
    heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    return 2 * int(config["num_hidden_layers"]) * chunk_tokens * heads * head_dim \
        * DTYPE_BYTES[dtype]


def model_chunk_bytes(model_folder: Path, chunk_tokens: int, dtype: str = "float32") -> int:
    return kv_chunk_bytes(json.loads((model_folder / "config.json").read_text()), chunk_tokens,
                          dtype)


def measure_reads(folder: Path, chunk_bytes: int, chunks: int = 32, io: str = "direct"
                  ) -> DiskReads:
    """Write ``chunks`` chunk files under ``folder``, read each once with ``io``, time the
    reads, remove the files. Buffered reads right after the writes come from the page cache:
    that is the point of measuring them beside direct ones."""
    if io not in ("direct", "buffered"):
        raise ValueError(f"io: {io!r}, expected direct or buffered")
    folder.mkdir(parents=True, exist_ok=True)
    size = -(-chunk_bytes // mmap.PAGESIZE) * mmap.PAGESIZE  # O_DIRECT: whole pages
    payload = os.urandom(size)
    paths = [folder / f".read-probe-{i}" for i in range(chunks)]
    times = []
    buf = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT requires
    try:
        for p in paths:
            p.write_bytes(payload)
        flags = os.O_RDONLY | (os.O_DIRECT if io == "direct" else 0)
        for p in paths:
            t0 = time.perf_counter()
            fd = os.open(p, flags)
            try:
                got = os.preadv(fd, [buf], 0)
            finally:
                os.close(fd)
            times.append(time.perf_counter() - t0)
            if got != size:
                raise OSError(f"{p}: read {got} of {size} bytes")
    finally:
        buf.close()
        for p in paths:
            p.unlink(missing_ok=True)
    total = sum(times)
    ms = np.asarray(times) * 1e3
    return DiskReads(io=io, chunk_bytes=size, chunks=chunks,
                     read_gbps=round(size * chunks / total / 1e9, 3) if total else 0.0,
                     read_p50_ms=round(float(np.percentile(ms, 50)), 4),
                     read_p95_ms=round(float(np.percentile(ms, 95)), 4))


def direct_io_error(folder: Path) -> str | None:
    """None when ``folder``'s filesystem serves O_DIRECT reads; else why not (older tmpfs and
    some overlay filesystems refuse the flag; a folder that cannot be made fails too): one
    page-sized ``measure_reads`` with O_DIRECT."""
    try:
        measure_reads(folder, mmap.PAGESIZE, chunks=1, io="direct")
    except OSError as exc:
        return f"{folder}: cannot be read with O_DIRECT ({exc.strerror or exc})"
    return None
