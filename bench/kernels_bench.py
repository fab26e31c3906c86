"""KV data-path kernels (seed 003 section 2.3), side by side in one run.

1. One staged copy of 16 blocks x 32 layers (K and V) into a contiguous staging buffer against
   the same data moved as 512 separate per-(layer, block) copies, and as 1,024 per-(layer,
   block, K/V) copies (the seed: 0.91 ms staged vs 12.81 ms as 1,024 small DMAs on Ascend, 14x).
   On the CPU this is the PyTorch reference; the Triton interpreter is a correctness path, not a
   performance one (~1 ms per program), so it is not timed here.
2. Chunked-prefill mask memory at 128 k context: the valid-shape mask [C, D+C] against the
   [C, max_len] one, per chunk and summed over a whole 128 k prefill (bool and fp16 additive);
   the Triton offset-causal kernel keeps no mask in memory at all.
3. On a GPU (only where one is present): the Triton gather's achieved bandwidth as a fraction
   of the device's peak.
4. The worker's path (``engine.kv.connector``): restoring a 16-chunk prefix (256-token LMCache
   ``KV_2LTD`` chunks) into the engine's cache, as before (per-(chunk, layer, K/V) strided
   copies into contiguous per-layer tensors), as one ``scatter_blocks`` launch per chunk into
   the paged blocks (the synchronous load), and as one launch per (chunk, layer) (the
   layer-wise load); and storing them back (``gather_blocks`` into the chunk objects).

    python -m bench kernels [--quick] [--out bench/results/kernels.json]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from agentserving.kernels import gather_blocks, prefill_mask, split_stacked, triton_available
from agentserving.kernels import reference as ref
from bench.common import add_out_args, write_result

# HBM peak (bytes/s) by device-name substring; None when unknown.
PEAK_BW = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L40S": 0.864e12, "A10": 0.6e12,
           "L4": 0.3e12, "MI300X": 5.3e12}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=16, help="Blocks staged per layer.")
    parser.add_argument("--block-size", type=int, default=128, help="Tokens per block (page).")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="float16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--context", type=int, default=131_072, help="max_model_len for masks.")
    parser.add_argument("--chunk", type=int, default=2048, help="Prefill chunk C for masks.")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1: multi-threaded copies on a shared, busy "
                             "host measured 10x noise from thread contention).")
    add_out_args(parser, Path("bench/results/kernels.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.kv_heads, args.head_dim = 5, 2, 64
    return args


def lmcache_available() -> bool:
    """The worker-path figures copy into LMCache's own chunk objects' layout."""
    try:
        import lmcache  # noqa: F401
    except ImportError:
        return False
    return True


def time_ms(fn, repeats: int, sync=lambda: None) -> dict[str, float]:  # type: ignore[no-untyped-def]
    fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - start) * 1e3)
    samples.sort()
    return {"p50_ms": statistics.median(samples), "min_ms": samples[0],
            "p95_ms": samples[int(0.95 * (len(samples) - 1))]}


def staged_vs_small(args: argparse.Namespace, device: str, impl: str) -> dict:
    dtype = getattr(torch, args.dtype)
    pool = args.blocks * 4  # the cache holds more blocks than are staged
    cache = torch.randn(args.layers, 2, pool, args.block_size, args.kv_heads, args.head_dim,
                        device=device).to(dtype)
    k, v = split_stacked(cache)
    table = torch.randperm(pool)[:args.blocks].to(device)  # scattered physical blocks
    out = torch.empty(args.layers, 2, args.blocks * args.block_size, args.kv_heads,
                      args.head_dim, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    staged = time_ms(lambda: gather_blocks(k, v, table, out=out, impl=impl), args.repeats, sync)
    check = out.clone()
    small = time_ms(lambda: ref.per_block_gather_stacked(cache, table, out), args.repeats, sync)
    assert torch.equal(out, check)  # same bytes either way
    split = time_ms(lambda: ref.per_block_gather(k, v, table, out.shape[2], out, split_kv=True),
                    args.repeats, sync)
    assert torch.equal(out, check)
    nbytes = out.numel() * out.element_size()
    n = args.layers * args.blocks
    return {
        "impl": impl, "device": device, "bytes": nbytes,
        "staged_one_copy": {**staged, "copies": 1, "launches": 2 if impl != "triton" else 1},
        f"per_block_{n}_copies": {**small, "copies": n},
        f"per_block_kv_{2 * n}_copies": {**split, "copies": 2 * n},
        "ratio_small_over_staged": small["p50_ms"] / staged["p50_ms"],
        "ratio_kv_small_over_staged": split["p50_ms"] / staged["p50_ms"],
        "staged_GBps": nbytes / (staged["p50_ms"] * 1e-3) / 1e9,
    }


def worker_path(args: argparse.Namespace, chunks: int = 16, chunk: int = 256,
                block: int = 64) -> dict:
    """Restore/store a prefix between LMCache chunk objects and the engine's cache."""
    import types

    from agentserving.engine.kv.connector import CPUKVConnector
    from agentserving.engine.kv.paged import KVBlockPool
    from agentserving.kernels import scatter_blocks

    dtype = getattr(torch, args.dtype)
    L, H, D = args.layers, args.kv_heads, args.head_dim
    conn = CPUKVConnector(L, H, D)
    objs = [types.SimpleNamespace(tensor=torch.randn(2, L, chunk, H * D).to(dtype))
            for _ in range(chunks)]
    n = chunks * chunk
    dense = [(torch.empty(1, H, n, D, dtype=dtype), torch.empty(1, H, n, D, dtype=dtype))
             for _ in range(L)]
    pool = KVBlockPool(L, 2 * n // block, block, H, D, dtype)
    pool.reserve(block * 3).release()  # the prefix's table starts mid-pool
    kv = pool.reserve(n)

    def before() -> None:
        for i, obj in enumerate(objs):
            conn.to_gpu(obj, i * chunk, (i + 1) * chunk, layers=dense)

    def paged_sync() -> None:
        for i, obj in enumerate(objs):
            conn.to_gpu(obj, i * chunk, (i + 1) * chunk, paged=kv)

    staged = [o.tensor.view(2, L, chunk, H, D) for o in objs]
    tables = [kv.chunk_table(i * chunk, (i + 1) * chunk) for i in range(chunks)]

    def paged_layerwise() -> None:
        for layer in range(L):
            for src, table in zip(staged, tables, strict=True):
                scatter_blocks(src[:, layer], pool.k[layer], pool.v[layer], table, tokens=chunk)

    def store_paged() -> None:
        for i, obj in enumerate(objs):
            conn.from_gpu(obj, i * chunk, (i + 1) * chunk, paged=kv)

    t_before = time_ms(before, args.repeats)
    t_sync = time_ms(paged_sync, args.repeats)
    got = kv.layers(n)
    assert all(torch.equal(a, b) and torch.equal(c, d)
               for (a, c), (b, d) in zip(got, dense, strict=True))  # same KV either way
    t_layer = time_ms(paged_layerwise, args.repeats)
    t_store = time_ms(store_paged, args.repeats)
    nbytes = sum(o.tensor.numel() * o.tensor.element_size() for o in objs)
    return {
        "chunks": chunks, "chunk_tokens": chunk, "block_size": block, "bytes": nbytes,
        "restore_before_strided_copies": {**t_before, "copies": chunks * L * 2},
        "restore_paged_one_launch_per_chunk": {**t_sync, "launches": chunks},
        "restore_paged_layerwise_launch_per_chunk_layer": {**t_layer, "launches": chunks * L},
        "store_paged_gather_one_launch_per_chunk": {**t_store, "launches": chunks},
        "ratio_before_over_paged": t_before["p50_ms"] / t_sync["p50_ms"],
        "paged_restore_GBps": nbytes / (t_sync["p50_ms"] * 1e-3) / 1e9,
    }


def mask_memory(args: argparse.Namespace) -> dict:
    c, max_len = args.chunk, args.context
    per_chunk = []
    for total in (4096, 16_384, 65_536, max_len):
        if total < c or total > max_len:
            continue
        cached = total - c
        mask = prefill_mask(c, cached)  # built for real: its storage is what is counted
        valid = mask.untyped_storage().nbytes()
        assert mask.shape == (c, cached + c)
        per_chunk.append({"cached": cached, "chunk": c, "valid_shape": list(mask.shape),
                          "valid_bytes_bool": valid, "full_bytes_bool": c * max_len,
                          "valid_bytes_fp16": 2 * valid, "full_bytes_fp16": 2 * c * max_len,
                          "full_over_valid": c * max_len / valid})
        del mask
    chunks = max_len // c  # a whole max_len prefill in chunks of C
    valid_total = sum(c * (i + 1) * c for i in range(chunks))
    full_total = chunks * c * max_len
    return {"context": max_len, "chunk": c, "per_chunk": per_chunk,
            "whole_prefill": {"chunks": chunks, "valid_bytes_bool": valid_total,
                              "full_bytes_bool": full_total,
                              "full_over_valid": full_total / valid_total},
            "offset_causal_triton_mask_bytes": 0,
            "note": "a [C, max_len] mask is also re-read by every layer; the valid one is read "
                    "in proportion to its size, the offset-causal kernel reads none"}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    report: dict = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "host": {"cpu": platform.processor() or platform.machine(),
                 "threads": torch.get_num_threads(), "torch": torch.__version__},
        "seed_003": {"staged_ms": 0.91, "small_copies_ms": 12.81, "small_copies": 1024,
                     "ratio": 12.81 / 0.91},
        "staging_cpu_reference": staged_vs_small(args, "cpu", "reference"),
        "mask_memory": mask_memory(args),
        "worker_path_cpu": worker_path(args) if lmcache_available() else
        "skipped: LMCache is not installed (the engine's chunk objects are LMCache's)",
        "triton_interpreter": "correctness path only (tests); ~1 ms per program, not timed",
    }
    if torch.cuda.is_available() and triton_available():
        gpu = staged_vs_small(args, "cuda", "triton")
        name = torch.cuda.get_device_name()
        peak = next((bw for key, bw in PEAK_BW.items() if key in name), None)
        # a gather reads and writes every byte once
        gpu["achieved_GBps_read_plus_write"] = 2 * gpu["staged_GBps"]
        gpu["peak_GBps"] = peak / 1e9 if peak else None
        gpu["fraction_of_peak"] = 2 * gpu["staged_GBps"] * 1e9 / peak if peak else None
        report["staging_gpu_triton"] = {"device_name": name, **gpu}
    else:
        report["staging_gpu_triton"] = "skipped: no GPU (or no triton) on this machine"
    s = report["staging_cpu_reference"]
    n = args.layers * args.blocks
    print(f"staging {args.blocks} blocks x {args.layers} layers, {s['bytes'] / 2**20:.1f} MiB, "
          f"cpu reference:")
    print(f"  one staged copy      {s['staged_one_copy']['p50_ms']:9.3f} ms p50")
    print(f"  {n} block copies    {s[f'per_block_{n}_copies']['p50_ms']:9.3f} ms p50 "
          f"(x{s['ratio_small_over_staged']:.2f})")
    print(f"  {2 * n} K/V copies    {s[f'per_block_kv_{2 * n}_copies']['p50_ms']:9.3f} ms p50 "
          f"(x{s['ratio_kv_small_over_staged']:.2f})   seed: x{12.81 / 0.91:.1f}")
    m = report["mask_memory"]
    for row in m["per_chunk"]:
        print(f"  mask C={row['chunk']} D={row['cached']}: valid {row['valid_bytes_bool']:,} B "
              f"vs full {row['full_bytes_bool']:,} B (x{row['full_over_valid']:.1f})")
    w = m["whole_prefill"]
    print(f"  whole {m['context']} prefill: valid {w['valid_bytes_bool']:,} B vs full "
          f"{w['full_bytes_bool']:,} B (x{w['full_over_valid']:.2f})")
    wp = report["worker_path_cpu"]
    if isinstance(wp, dict):
        print(f"  worker restore of {wp['chunks']} chunks: before "
              f"{wp['restore_before_strided_copies']['p50_ms']:.3f} ms "
              f"({wp['restore_before_strided_copies']['copies']} copies), paged "
              f"{wp['restore_paged_one_launch_per_chunk']['p50_ms']:.3f} ms "
              f"({wp['chunks']} launches), layer-wise "
              f"{wp['restore_paged_layerwise_launch_per_chunk_layer']['p50_ms']:.3f} ms; store "
              f"{wp['store_paged_gather_one_launch_per_chunk']['p50_ms']:.3f} ms")
    if isinstance(report["staging_gpu_triton"], dict):
        g = report["staging_gpu_triton"]
        print(f"  gpu triton: {g['staged_one_copy']['p50_ms']:.3f} ms, fraction of peak "
              f"{g['fraction_of_peak']}")
    write_result(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
