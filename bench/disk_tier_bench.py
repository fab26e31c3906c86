"""What a KV reload costs from each tier: DRAM, the disk tier through the page cache, and the
disk tier with O_DIRECT (``--disk-io direct``), the same chunks read through LMCache's real
backends.

A disk tier read through the page cache is a DRAM copy whenever the host has memory to spare,
so a benchmark on it finds the disk as fast as DRAM and a prefetch from it worthless. This bench
stores the same sessions' KV (the tiny model's, computed by a real forward) on a KV store with
buffered disk I/O and on one with direct disk I/O, then reloads every session's prefix
(``KVStore.load_prefix``: read, verify, copy out) three ways, interleaved: from DRAM, and with
DRAM evicted, from each disk tier. Also the raw read probe the main job writes into its
report.json (``engine.kv.disk_probe``): one chunk file per read, O_DIRECT vs page cache.

    python -m bench disk_tier [--quick] [--sessions N] [--prefix TOKENS]
                              [--out bench/results/disk_tier.json]

Ratios are what to read (tier / DRAM within this run); a shared host's absolute times drift.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import add_out_args, percentile, write_result

TIERS = ("dram", "disk_buffered", "disk_direct")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench disk_tier", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=12, help="Sessions (prefixes) per tier.")
    p.add_argument("--prefix", type=int, default=4096, help="Cached prefix tokens per session "
                   "(whole 256-token chunks).")
    p.add_argument("--rounds", type=int, default=3, help="Reloads of every prefix per tier.")
    add_out_args(p, Path("bench/results/disk_tier.json"), "3 sessions of 1,024 tokens, one round")
    args = p.parse_args(argv)
    if args.quick:
        args.sessions, args.prefix, args.rounds = 3, 1024, 1
    return args


def _store(tmp: Path, name: str, bundle: Any, disk_io: str) -> Any:
    from agentserving.engine.builder import build_engine
    from agentserving.engine.settings import WorkerSettings

    return build_engine(WorkerSettings(cpu_cache_gib=2.0, disk_cache_dir=tmp / name,
                                       disk_cache_gib=4.0, kv_cache_gib=1.0, pod_name=name,
                                       disk_io=disk_io), bundle=bundle)


def _sessions(args: argparse.Namespace, bundle: Any) -> list[tuple[list[int], Any]]:
    """Each session's prompt and its KV layers, from a real forward of the tiny model."""
    from agentserving.engine.model.runner import ModelRunner
    from testkit.worker import prompt

    runner = ModelRunner(bundle)
    out = []
    for i in range(args.sessions):
        ids = prompt(args.prefix, seed=100 + i)
        cache = runner.new_cache()
        with torch.inference_mode():
            runner.forward(ids, cache, 0)
        out.append((ids, runner.cache_layers(cache)))
    return out


def _evict_dram(store: Any, ints: list[int]) -> None:
    store.evict([store.keys.wire_of_int(h) for h in ints], store.resolve_locations(["cpu"]))


def _reload(store: Any, ints: list[int], tier: str) -> tuple[float, int]:
    """One prefix reload from ``tier``: (seconds, bytes)."""
    from agentserving.core.schemas import Tier

    if tier != "dram":
        _evict_dram(store, ints)
    t0 = time.perf_counter()
    res = store.load_prefix(ints)
    dt = time.perf_counter() - t0
    want = Tier.CPU if tier == "dram" else Tier.DISK
    if res.tokens_by_tier != {want: res.num_tokens} or not res.num_tokens:
        raise RuntimeError(f"{tier}: reloaded {res.tokens_by_tier}, expected all from {want}")
    nbytes = sum(k.numel() * k.element_size() * 2 for k, _ in res.layers)
    return dt, nbytes


def reload_rows(args: argparse.Namespace, bundle: Any, tmp: Path) -> dict[str, Any]:
    sessions = _sessions(args, bundle)
    engines = {"buffered": _store(tmp, "buffered", bundle, "buffered"),
               "direct": _store(tmp, "direct", bundle, "direct")}
    try:
        prefixes = []
        for ids, layers in sessions:
            for parts in engines.values():
                parts.store.store(ids, layers)
            prefixes.append(ids)
        for parts in engines.values():
            parts.store.wait_disk_writes()
        samples: dict[str, list[float]] = {t: [] for t in TIERS}
        nbytes: dict[str, int] = {t: 0 for t in TIERS}
        for _ in range(args.rounds):
            for ids in prefixes:
                for tier in TIERS:  # interleaved: the host's drift hits every tier alike
                    store = engines["direct" if tier == "disk_direct" else "buffered"].store
                    ints = store.keys.int_hashes(ids)
                    dt, n = _reload(store, ints, tier)
                    samples[tier].append(dt)
                    nbytes[tier] += n
        chunks = args.prefix // 256
        rows = {}
        for tier in TIERS:
            xs = samples[tier]
            rows[tier] = {"reload_p50_ms": round(1e3 * percentile(xs, 0.5), 3),
                          "reload_p95_ms": round(1e3 * percentile(xs, 0.95), 3),
                          "per_chunk_p50_ms": round(1e3 * percentile(xs, 0.5) / chunks, 4),
                          "gbps": round(nbytes[tier] / sum(xs) / 1e9, 3), "reloads": len(xs)}
        for tier in TIERS[1:]:
            rows[tier]["vs_dram_p50"] = round(rows[tier]["reload_p50_ms"]
                                              / rows["dram"]["reload_p50_ms"], 2)
        return rows
    finally:
        for parts in engines.values():
            parts.close()


def probe_rows(tmp: Path, chunk_bytes: int, chunks: int) -> dict[str, Any]:
    from agentserving.engine.kv.disk_probe import direct_io_error, measure_reads

    out = {"buffered": measure_reads(tmp / "probe", chunk_bytes, chunks, io="buffered").as_dict()}
    why = direct_io_error(tmp)
    out["direct"] = (measure_reads(tmp / "probe", chunk_bytes, chunks, io="direct").as_dict()
                     if why is None else {"error": why})
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    from agentserving.engine.kv.disk_probe import direct_io_error, kv_chunk_bytes
    from agentserving.engine.model.loader import TINY_CONFIG, load_model

    bundle = load_model("tiny")
    result: dict[str, Any] = {
        "benchmark": "disk_tier",
        "host": {"machine": platform.machine(), "python": sys.version.split()[0],
                 "torch": torch.__version__},
        "model": "tiny (4 layers, 4 kv heads x 64, fp32: 2 MiB per 256-token chunk)",
        "params": {k: str(v) for k, v in vars(args).items()},
        "notes": "reload = KVStore.load_prefix of one session's prefix (LMCache read, "
                 "checksum, copy out); disk tiers read with DRAM evicted first. "
                 "vs_dram_p50: reload P50 over DRAM's, within this run.",
    }
    with tempfile.TemporaryDirectory(prefix="disk-tier-bench-") as tmp:
        if (why := direct_io_error(Path(tmp))) is not None:
            print(f"disk_tier: {why}; nothing to compare")
            return 1
        result["reload"] = reload_rows(args, bundle, Path(tmp))
        result["probe"] = probe_rows(Path(tmp), kv_chunk_bytes(dict(TINY_CONFIG), 256),
                                     8 if args.quick else 64)
    for tier, row in result["reload"].items():
        print(f"{tier:14s} reload P50 {row['reload_p50_ms']:8.2f} ms  {row['gbps']:6.2f} GB/s"
              + (f"  x{row['vs_dram_p50']} DRAM" if "vs_dram_p50" in row else ""))
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
