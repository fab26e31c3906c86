"""kvindex benchmark: event ingest and ``lookup`` latency, in-memory and Redis side by side.

    python -m bench.kvindex_bench --out bench/results/kvindex.json [--quick] [--redis-url URL]

Setup: 16 pods hold 1 M chunks in total (preloaded through each backend's bulk path,
``replace_chunks``). Pod ``i`` holds the first ``32 * (i + 1)`` chunks of one 512-chunk chain
(spread over the device, cpu and disk tiers), so a lookup of that chain finds all 16 pods and
checks 4,368 (pod, chunk) pairs; the rest of each pod's chunks are random, on disk.

- ``lookup``: ``Index.lookup(chain)`` one call at a time; p50/p90/p99/max latency in ms.
- ``ingest``: ``Index.apply_events`` with batches of 512 chunk events, each pod's batches in seq
  order, in chunk-events/s. Three runs: ``steady`` batches (256 chunks stored on cpu + 256 of the
  pod's chunks removed from disk, so the index stays at 1 M chunks, as a full cache churns) one
  at a time and with one batch in flight per pod (16 at once, as a kvindex serving 16 pods sees
  them; the headline number), then ``growth`` batches (512 new chunks stored, 16 in flight),
  which also pay for the index's hash tables growing past 1 M entries.

Without ``--redis-url`` a private redis-server is started on a free loopback port (no
persistence). Targets: Redis ingest >= 200 k chunk-events/s, Redis lookup p99 <= 2 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from agentserving.core.schemas import (
    ChunkSnapshot,
    EventBatch,
    EventOp,
    PodRegistration,
    ResidencyEvent,
    Tier,
)
from agentserving.kvindex.index.base import Index
from agentserving.kvindex.index.memory import InMemoryIndex
from agentserving.kvindex.index.redis import RedisIndex
from bench.common import add_out_args, progress, write_result

NAME = "kvindex"
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / f"{NAME}.json"
TARGET_INGEST = 200_000  # chunk-events/s, Redis
TARGET_P99_MS = 2.0  # lookup, Redis

FULL = {"pods": 16, "total_chunks": 1_000_000, "chain": 512, "batch": 512,
        "ingest_chunk_events": 262_144, "lookups": 2000, "warmup": 100}
QUICK = {"pods": 16, "total_chunks": 32_768, "chain": 512, "batch": 512,
         "ingest_chunk_events": 16_384, "lookups": 200, "warmup": 20}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.kvindex_bench",
                                     description=__doc__.split("\n\n")[0])
    add_out_args(parser, DEFAULT_OUT, "32 k chunks, 200 lookups, 16 k events")
    parser.add_argument("--redis-url", default=None,
                        help="an existing Redis to use (its keys under --key-prefix are "
                             "deleted); default: start a private redis-server")
    parser.add_argument("--key-prefix", default="asbench:", help="Redis key prefix")
    parser.add_argument("--seed", type=int, default=7, help="random seed for chunk ids")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------- workload


def hex_ids(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct 64-digit chunk hashes (blake3-sized)."""
    return [f"{rng.getrandbits(256):064x}" for _ in range(n)]


class Workload:
    def __init__(self, sizes: dict[str, int], seed: int) -> None:
        rng = random.Random(seed)
        self.sizes = sizes
        self.pods = [f"bench-pod-{i:02d}" for i in range(sizes["pods"])]
        self.chain = hex_ids(rng, sizes["chain"])
        per_pod = sizes["total_chunks"] // sizes["pods"]
        step = sizes["chain"] // sizes["pods"]
        self.snapshots: dict[str, ChunkSnapshot] = {}
        self.expected: dict[str, int] = {}
        self.removable: dict[str, list[str]] = {}  # chunks a steady batch may remove
        for i, pod in enumerate(self.pods):
            held = self.chain[: step * (i + 1)]
            third = max(1, len(held) // 3)
            filler = hex_ids(rng, per_pod - len(held))
            self.removable[pod] = filler[::-1]
            tiers = {Tier.DEVICE: held[:third], Tier.CPU: held[third:2 * third],
                     Tier.DISK: held[2 * third:] + filler}
            self.snapshots[pod] = ChunkSnapshot.model_construct(
                seq=1, chunks=tiers, bytes={t: len(c) * 2**20 for t, c in tiers.items()})
            self.expected[pod] = len(held)
        self.seq = {pod: 1 for pod in self.pods}  # the snapshot was seq 1
        self.steady_sequential = self.make_batches(rng, steady=True)
        self.steady_concurrent = self.make_batches(rng, steady=True)
        self.growth = self.make_batches(rng, steady=False)

    def make_batches(self, rng: random.Random, steady: bool) -> list[EventBatch]:
        """``ingest_chunk_events`` worth of batches, round-robin over the pods, seqs in order."""
        size = self.sizes["batch"]
        batches = []
        for b in range(max(1, self.sizes["ingest_chunk_events"] // size)):
            pod = self.pods[b % len(self.pods)]
            self.seq[pod] += 1
            if steady:
                removed = [self.removable[pod].pop() for _ in range(size // 2)]
                events = [
                    ResidencyEvent.model_construct(op=EventOp.STORED, tier=Tier.CPU,
                                                   chunk_hashes=hex_ids(rng, size - size // 2),
                                                   bytes=(size - size // 2) * 2**20),
                    ResidencyEvent.model_construct(op=EventOp.REMOVED, tier=Tier.DISK,
                                                   chunk_hashes=removed,
                                                   bytes=len(removed) * 2**20)]
            else:
                events = [ResidencyEvent.model_construct(op=EventOp.STORED, tier=Tier.CPU,
                                                         chunk_hashes=hex_ids(rng, size),
                                                         bytes=size * 2**20)]
            batches.append(EventBatch.model_construct(pod=pod, seq=self.seq[pod],
                                                      events=events))
        return batches

    @property
    def total_chunks(self) -> int:
        return sum(sum(len(c) for c in s.chunks.values()) for s in self.snapshots.values())


# ------------------------------------------------------------------------------- measuring


def percentiles(samples_ns: list[int]) -> dict[str, float]:
    ordered = sorted(samples_ns)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e6

    return {"p50_ms": round(pct(0.50), 4), "p90_ms": round(pct(0.90), 4),
            "p99_ms": round(pct(0.99), 4), "max_ms": round(ordered[-1] / 1e6, 4),
            "mean_ms": round(statistics.fmean(ordered) / 1e6, 4), "samples": len(ordered)}


async def preload(index: Index, work: Workload, bar: Any, label: str) -> float:
    task = bar.add_task(f"preload {label:<6}", total=work.total_chunks)
    start = time.perf_counter()
    for pod in work.pods:
        await index.register_pod(PodRegistration(
            pod=pod, memory_api_url="http://127.0.0.1:9", model="bench"), 3600)
        snapshot = work.snapshots[pod]
        await index.replace_chunks(pod, snapshot)
        bar.advance(task, sum(len(c) for c in snapshot.chunks.values()))
    return time.perf_counter() - start


async def bench_lookup(index: Index, work: Workload) -> dict[str, Any]:
    found = {p.pod: p.prefix_chunks for p in await index.lookup(work.chain)}
    if found != work.expected:
        raise AssertionError(f"lookup answered {found}, expected {work.expected}")
    for _ in range(work.sizes["warmup"]):
        await index.lookup(work.chain)
    samples = []
    gc.collect()
    gc.disable()  # a collection of the preloaded heap is not the index's latency
    try:
        for _ in range(work.sizes["lookups"]):
            start = time.perf_counter_ns()
            await index.lookup(work.chain)
            samples.append(time.perf_counter_ns() - start)
    finally:
        gc.enable()
    return {**percentiles(samples), "chain_chunks": len(work.chain),
            "pods_found": len(found), "pairs_walked": sum(found.values()) + len(found)}


async def ingest(index: Index, batches: list[EventBatch], concurrent: bool, bar: Any,
                 task: Any) -> float:
    """chunk-events/s for ``batches``: one at a time, or one in flight per pod."""
    per_pod: dict[str, list[EventBatch]] = {}
    for batch in batches:
        per_pod.setdefault(batch.pod if concurrent else "", []).append(batch)

    async def feed(mine: list[EventBatch]) -> int:
        n = 0
        for batch in mine:
            result = await index.apply_events(batch)
            if not result.applied or result.needs_resync:
                raise AssertionError(f"batch {batch.pod}#{batch.seq} not applied in order")
            n += result.chunk_events
            bar.advance(task)
        return n

    start = time.perf_counter()
    events = sum(await asyncio.gather(*(feed(b) for b in per_pod.values())))
    return events / (time.perf_counter() - start)


async def bench_ingest(index: Index, work: Workload, bar: Any, label: str) -> dict[str, Any]:
    runs = [work.steady_sequential, work.steady_concurrent, work.growth]
    task = bar.add_task(f"ingest  {label:<6}", total=sum(len(r) for r in runs))
    sequential = await ingest(index, work.steady_sequential, False, bar, task)
    concurrent = await ingest(index, work.steady_concurrent, True, bar, task)
    growth = await ingest(index, work.growth, True, bar, task)
    return {
        "chunk_events_per_s": round(concurrent),
        "sequential_chunk_events_per_s": round(sequential),
        "growth_chunk_events_per_s": round(growth),
        "concurrency": len(work.pods), "batch_chunk_events": work.sizes["batch"],
        "chunk_events_per_run": len(work.growth) * work.sizes["batch"],
    }


async def run_backend(label: str, index: Index, work: Workload, bar: Any) -> dict[str, Any]:
    try:
        preload_s = await preload(index, work, bar, label)
        await asyncio.sleep(1.0)  # let Redis finish rehashing what the preload grew
        lookup = await bench_lookup(index, work)
        ingest = await bench_ingest(index, work, bar, label)
    finally:
        if isinstance(index, RedisIndex):
            await index.flush_prefix()
        await index.close()
    return {"preload_s": round(preload_s, 3),
            "preload_chunks_per_s": round(work.total_chunks / preload_s),
            "lookup": lookup, "ingest": ingest}


# ------------------------------------------------------------------------------- report


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def summarize(results: dict[str, Any], work: Workload, args: argparse.Namespace,
              redis_info: dict[str, Any]) -> dict[str, Any]:
    mem, red = results["memory"], results["redis"]
    return {
        "bench": NAME,
        "quick": args.quick,
        "config": {**work.sizes, "chunks_loaded": work.total_chunks,
                   "python": platform.python_version(), "machine": platform.machine(),
                   "cpus": os.cpu_count(), "load_average_1m_at_start": args.load_at_start,
                   **redis_info},
        "memory": mem,
        "redis": red,
        "ratios": {  # Redis over in-memory
            "ingest": ratio(red["ingest"]["chunk_events_per_s"],
                            mem["ingest"]["chunk_events_per_s"]),
            "ingest_sequential": ratio(red["ingest"]["sequential_chunk_events_per_s"],
                                       mem["ingest"]["sequential_chunk_events_per_s"]),
            "ingest_growth": ratio(red["ingest"]["growth_chunk_events_per_s"],
                                   mem["ingest"]["growth_chunk_events_per_s"]),
            "lookup_p50": ratio(red["lookup"]["p50_ms"], mem["lookup"]["p50_ms"]),
            "lookup_p99": ratio(red["lookup"]["p99_ms"], mem["lookup"]["p99_ms"]),
        },
        "targets": {
            "redis_ingest_chunk_events_per_s": TARGET_INGEST,
            "redis_lookup_p99_ms": TARGET_P99_MS,
            "redis_ingest_met": red["ingest"]["chunk_events_per_s"] >= TARGET_INGEST,
            "redis_lookup_p99_met": red["lookup"]["p99_ms"] <= TARGET_P99_MS,
        },
    }


def print_table(report: dict[str, Any]) -> None:
    mem, red, r = report["memory"], report["redis"], report["ratios"]
    rows = [
        ("ingest, steady, 16 in flight (ev/s)", mem["ingest"]["chunk_events_per_s"],
         red["ingest"]["chunk_events_per_s"], r["ingest"], f">= {TARGET_INGEST:,}"),
        ("ingest, steady, sequential (ev/s)", mem["ingest"]["sequential_chunk_events_per_s"],
         red["ingest"]["sequential_chunk_events_per_s"], r["ingest_sequential"], ""),
        ("ingest, growth, 16 in flight (ev/s)", mem["ingest"]["growth_chunk_events_per_s"],
         red["ingest"]["growth_chunk_events_per_s"], r["ingest_growth"], ""),
        ("lookup p50 (ms)", mem["lookup"]["p50_ms"], red["lookup"]["p50_ms"], r["lookup_p50"], ""),
        ("lookup p99 (ms)", mem["lookup"]["p99_ms"], red["lookup"]["p99_ms"], r["lookup_p99"],
         f"<= {TARGET_P99_MS}"),
        ("lookup max (ms)", mem["lookup"]["max_ms"], red["lookup"]["max_ms"], None, ""),
        ("preload (chunks/s)", mem["preload_chunks_per_s"], red["preload_chunks_per_s"], None, ""),
    ]

    def fmt(v: Any) -> str:
        if v is None:
            return "-"
        return f"{v:,}" if isinstance(v, int) else f"{v:,.3f}"

    cfg = report["config"]
    title = (f"kvindex: {cfg['chunks_loaded']:,} chunks on {cfg['pods']} pods, "
             f"{cfg['chain']}-chunk chain, batches of {cfg['batch']}"
             + (" (quick)" if report["quick"] else ""))
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print(f"{'':40} {'memory':>14} {'redis':>14} {'redis/mem':>10} {'target':>12}")
        for name, *vals, target in rows:
            print(f"{name:40} " + " ".join(f"{fmt(v):>14}" for v in vals[:2])
                  + f" {fmt(vals[2]):>10} {target:>12}")
        return
    table = Table(title=title)
    for col in ("", "memory", "redis", "redis/memory", "target (redis)"):
        table.add_column(col, justify="left" if not col else "right", no_wrap=True)
    for name, *vals, target in rows:
        table.add_row(name, *(fmt(v) for v in vals), target)
    Console(width=None if sys.stdout.isatty() else 120).print(table)


# ------------------------------------------------------------------------------- main


async def run(args: argparse.Namespace) -> dict[str, Any]:
    args.load_at_start = round(os.getloadavg()[0], 2)  # the machine may be shared: say so
    sizes = QUICK if args.quick else FULL
    work = Workload(sizes, args.seed)
    server = None
    url = args.redis_url
    if url is None:
        from testkit.servers import RedisServer

        server = RedisServer()
        url = server.url
    try:
        # Preloading sends a pod's whole residency in one script: give it time.
        redis_index = RedisIndex(url, key_prefix=args.key_prefix, op_timeout_s=120.0)
        await redis_index.flush_prefix()
        info = await redis_index._redis.info("server")  # noqa: SLF001 - bench-only peek
        redis_info = {"redis_version": info.get("redis_version"),
                      "redis_url": url if args.redis_url else "private redis-server (loopback)"}
        try:
            import hiredis

            redis_info["hiredis"] = hiredis.__version__
        except ImportError:
            redis_info["hiredis"] = None
        results = {}
        with progress(not args.no_progress) as bar:
            results["memory"] = await run_backend("memory", InMemoryIndex(), work, bar)
            results["redis"] = await run_backend("redis", redis_index, work, bar)
    finally:
        if server is not None:
            server.stop()
    redis_info["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    return summarize(results, work, args, redis_info)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = asyncio.run(run(args))
    print_table(report)
    write_result(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
