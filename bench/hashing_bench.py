"""chunk_hash throughput: a 131,072-token prompt (512 chunks of 256), each scheme, each input
type, side by side in one run. The aim: blake3 under 1 ms.

    python -m bench hashing [--quick] [--out bench/results/hashing.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from agentserving.core.hashing import ChunkHasher, HashScheme
from bench.common import add_out_args, write_result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench hashing", description=__doc__)
    parser.add_argument("--tokens", type=int, default=131_072, help="Prompt length in tokens.")
    parser.add_argument("--repeats", type=int, default=200, help="Timed runs per case.")
    add_out_args(parser, Path("bench/results/hashing.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats = 10
    return args


def time_ms(fn, repeats: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    fn()  # warm
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    samples.sort()
    return {"p50_ms": statistics.median(samples), "min_ms": samples[0],
            "p95_ms": samples[int(0.95 * (len(samples) - 1))]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tokens = np.random.default_rng(0).integers(0, 151_000, args.tokens).astype(np.int64)
    inputs = {"ndarray": tokens, "list": tokens.tolist()}
    results: dict[str, dict[str, dict[str, float]]] = {}
    for scheme in HashScheme:
        hasher = ChunkHasher(scheme, 256)
        repeats = args.repeats if scheme is HashScheme.BLAKE3 else max(3, args.repeats // 10)
        results[scheme.value] = {kind: time_ms(lambda h=hasher, x=data: h.hashes(x), repeats)
                                 for kind, data in inputs.items()}
    blake3_ms = results["blake3"]["ndarray"]["p50_ms"]
    report = {
        "tokens": args.tokens, "chunks": args.tokens // 256, "results": results,
        "ratios": {f"{s}_vs_blake3": results[s]["list"]["p50_ms"] / results["blake3"]["list"][
            "p50_ms"] for s in results if s != "blake3"},
        "target": {"blake3_p50_ms_max": 1.0, "met": blake3_ms < 1.0},
    }
    print(f"{'scheme':<18}{'input':<10}{'p50 ms':>10}{'min ms':>10}{'p95 ms':>10}")
    for scheme, by_kind in results.items():
        for kind, r in by_kind.items():
            print(f"{scheme:<18}{kind:<10}{r['p50_ms']:>10.3f}{r['min_ms']:>10.3f}"
                  f"{r['p95_ms']:>10.3f}")
    write_result(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
