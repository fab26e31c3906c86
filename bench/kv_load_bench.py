"""The worker's KV data path on the real engine (issues 4, 7, 9): layer-wise load vs the
non-overlapped load, decode cost per token, and what a decode pod's local prefix costs the
step loop.

1. ``load``: sessions whose long prefix is cached (LMCache DRAM, and disk) come back for a new
   turn. Each turn's admission step is measured on the reference engine (tiny Llama, CPU):
   *exposed* KV time (load time on the step's critical path: fetching and verifying chunks,
   plus every wait of a layer for its own KV) against *forward* time (the step's compute,
   waits excluded), P50/P95, for ``layerwise`` (copy into the paged blocks on a thread, layer i
   waits for layer i only) and ``sync`` (every layer copied before the forward), side by side
   on the same engine, turns interleaved. Seed 003: 15 ms / 472 ms exposed vs 4.16 s / 5.30 s
   forward; target: exposed P50 < 1% of forward.
2. ``decode``: time per decoded token at several context lengths, ``DynamicCache`` (grows by
   ``torch.cat`` every token: the engine before) vs the paged cache (one token written in
   place, attention reads a view of the blocks). Same logits (checked).
   ``queued_cpu``: the same turns all queued at once on a busy pod (one running at a time): the
   queue head's load starts while the step before it runs; exposed vs forward per step.
   ``queued_disk``: the same busy pod, every queued turn's prefix on LMCache's disk tier only,
   under the same admission policy (``longcap-dynamic``) without and with the
   ShadowScheduler's N+1 prefetch (``shadow``: the turn predicted for the next step has its
   chunks moved disk -> DRAM while this step computes). Per mode: exposed vs forward per
   prefill step, how many turns were prefetched and how many of those prefetches had
   completed when the engine fetched the turn's prefix (a late one is waited for, never read
   twice), and where the admitted prefixes were read from.
3. ``pull_prefix``: a decode pod's local prefix read (``KVStore.load_prefix``), which ran
   inside the step loop before (in ``add()``), against what ``add()`` costs the loop now (the
   read runs on a worker thread).

    python -m bench kv_load [--quick] [--sections load,decode,pull]
                            [--out bench/results/kv_load.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import add_out_args, percentile, write_result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench kv_load", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefix", type=int, default=8192, help="Cached prefix tokens per session.")
    p.add_argument("--suffix", type=int, default=300, help="New tokens per turn.")
    p.add_argument("--turns", type=int, default=16, help="Turns per mode and tier.")
    p.add_argument("--contexts", default="1024,4096,16384", help="Decode contexts.")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="torch threads (shared host: 1).")
    add_out_args(p, Path("bench/results/kv_load.json"))
    p.add_argument("--sections", default="load,decode,pull",
                   help="Comma-separated subset of load,decode,pull.")
    args = p.parse_args(argv)
    if args.quick:
        args.prefix, args.turns, args.contexts, args.decode_tokens = 2048, 4, "1024,4096", 8
    return args


def stats(xs: list[float]) -> dict[str, float]:
    return {"p50": percentile(xs, 0.5), "p95": percentile(xs, 0.95),
            "mean": statistics.fmean(xs), "n": len(xs)}


def _engine(tmp: Path, bundle: Any, **overrides: Any) -> Any:
    from agentserving.engine.builder import build_engine
    from agentserving.engine.settings import WorkerSettings

    settings = WorkerSettings(cpu_cache_gib=2.0, disk_cache_dir=tmp / "disk",
                              disk_cache_gib=4.0, kv_cache_gib=2.0, pod_name="bench",
                              **overrides)
    return build_engine(settings, bundle=bundle)


def _on_fresh_engine(tmp: Path, bundle: Any, rows: Any, args: argparse.Namespace
                     ) -> dict[str, Any]:
    """``rows(args, parts)`` on an engine of its own, closed afterwards."""
    parts = _engine(tmp, bundle)
    try:
        return rows(args, parts)
    finally:
        parts.close()


def load_section(args: argparse.Namespace, bundle: Any, tmp: Path) -> dict[str, Any]:
    return _on_fresh_engine(tmp / "load", bundle, _load_rows, args)


def _load_rows(args: argparse.Namespace, parts: Any) -> dict[str, Any]:
    from testkit.worker import prompt, request, run

    core, store = parts.core, parts.store
    core.record_steps = True
    sessions = [prompt(args.prefix, seed=1000 + i) for i in range(args.turns)]
    for i, ids in enumerate(sessions):  # first turns: their prefixes land in DRAM and disk
        run(parts, request(f"warm{i}", ids, max_tokens=1))
    assert store.wait_disk_writes(120)
    out: dict[str, Any] = {}
    for tier in ("cpu", "disk"):
        rows: dict[str, dict[str, list[float]]] = {
            m: {"exposed": [], "forward": [], "load": []} for m in ("layerwise", "sync")}
        for i, ids in enumerate(sessions):
            for mode in ("layerwise", "sync") if i % 2 == 0 else ("sync", "layerwise"):
                core.layerwise_load = mode == "layerwise"
                hashes = store.keys.int_hashes(torch.tensor(ids), None)
                if tier == "disk":  # only on disk: the turn's fetch reads and verifies files
                    store.evict([store.keys.wire_of_int(h) for h in hashes],
                                store.resolve_locations(["cpu"]))
                seed = 5000 + 1000 * (tier == "disk") + 500 * (mode == "sync") + i  # unseen suffix
                turn = ids + prompt(args.suffix, seed=seed)
                core.step_records.clear()
                before = core.stats.kv_load_seconds
                res = run(parts, request(f"{tier}-{mode}-{i}", turn, max_tokens=1))
                assert res["first"]["cached_tokens"] == args.prefix, res["first"]
                first = core.step_records[0]  # the admission step: the load happens here
                rows[mode]["exposed"].append(first.exposed_kv_s)
                rows[mode]["forward"].append(first.forward_s)
                rows[mode]["load"].append(core.stats.kv_load_seconds - before
                                          + res["first"]["load_seconds"] * (mode == "layerwise"))
        out[tier] = {}
        for mode, r in rows.items():
            e, f = stats(r["exposed"]), stats(r["forward"])
            out[tier][mode] = {"exposed_kv_s": e, "forward_s": f, "load_s": stats(r["load"]),
                               "exposed_p50_over_forward_p50": e["p50"] / f["p50"],
                               "exposed_p95_over_forward_p95": e["p95"] / f["p95"]}
        lw, sy = out[tier]["layerwise"], out[tier]["sync"]
        out[tier]["exposed_p50_sync_over_layerwise"] = (
            sy["exposed_kv_s"]["p50"] / max(lw["exposed_kv_s"]["p50"], 1e-9))
    out["queued_cpu"] = _queued_rows(args, parts, sessions)
    out["queued_disk"] = _queued_disk_rows(args, parts, sessions)
    return out


def _queued_rows(args: argparse.Namespace, parts: Any, sessions: list[list[int]]
                 ) -> dict[str, Any]:
    """A busy prefill pod: every session's next turn queued at once, one running at a time.
    The queue head's load starts a step early (``EngineCore._prepare_head``); exposed and
    forward time over every step of the run."""
    from testkit.worker import prompt, request

    core = parts.core
    core.max_running = 1
    out: dict[str, Any] = {}
    for mode in ("layerwise", "sync"):
        core.layerwise_load = mode == "layerwise"
        core.step_records.clear()
        for i, ids in enumerate(sessions):
            seed = 9000 + 500 * (mode == "sync") + i
            core.add(request(f"q-{mode}-{i}", ids + prompt(args.suffix, seed=seed),
                             max_tokens=1))
        while core.has_work():
            core.step()
            core.run_deferred()
        recs = [r for r in core.step_records if r.prefill_tokens]
        e, f = stats([r.exposed_kv_s for r in recs]), stats([r.forward_s for r in recs])
        out[mode] = {"exposed_kv_s": e, "forward_s": f,
                     "exposed_p50_over_forward_p50": e["p50"] / f["p50"],
                     "exposed_p95_over_forward_p95": e["p95"] / f["p95"],
                     "exposed_total_over_forward_total": (
                         sum(r.exposed_kv_s for r in recs) / sum(r.forward_s for r in recs))}
    core.max_running = 16
    return out


def _evict_dram(store: Any, sessions: list[list[int]]) -> None:
    """Leave every session's prefix on the disk tier only."""
    cpu = store.resolve_locations(["cpu"])
    for ids in sessions:
        hashes = store.keys.int_hashes(torch.tensor(ids), None)
        store.evict([store.keys.wire_of_int(h) for h in hashes], cpu)


QUEUED_DISK_MODES = {"no_prefetch": "longcap-dynamic", "shadow_prefetch": "shadow"}


def _queued_disk_rows(args: argparse.Namespace, parts: Any, sessions: list[list[int]],
                      rounds: int = 2) -> dict[str, Any]:
    """A busy pod whose queued turns' prefixes sit on disk only: ``longcap-dynamic`` alone
    (each head's prefix is read from disk when it is next in line) vs ``shadow`` (the same
    policy; the turn predicted for step N+1 is prefetched disk -> DRAM during step N). The
    modes alternate over ``rounds`` (A B, B A, ...) so host load drifts hit both alike."""
    core = parts.core
    saved_policy, core.max_running, core.layerwise_load = core.policy, 1, True
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in QUEUED_DISK_MODES}
    try:
        for r in range(rounds):
            order = list(QUEUED_DISK_MODES) if r % 2 == 0 else list(QUEUED_DISK_MODES)[::-1]
            for mode in order:
                runs[mode].append(_queued_disk_run(args, parts, sessions, mode, r))
    finally:
        core.policy, core.max_running = saved_policy, 16
    out: dict[str, Any] = {}
    for mode, rs in runs.items():
        exposed = [x for run_ in rs for x in run_["exposed"]]
        forward = [x for run_ in rs for x in run_["forward"]]
        e, f = stats(exposed), stats(forward)
        row: dict[str, Any] = {
            "policy": QUEUED_DISK_MODES[mode], "rounds": rounds,
            "exposed_kv_s": e, "forward_s": f,
            "exposed_p50_over_forward_p50": e["p50"] / f["p50"],
            "exposed_p95_over_forward_p95": e["p95"] / f["p95"],
            "exposed_total_over_forward_total": sum(exposed) / sum(forward),
            "step_total_s": sum(exposed) + sum(forward),
        }
        for key in ("turns", "turns_prefetched", "prefetches_done_before_admission",
                    "prefetch_waits", "prefetch_wait_s", "prefetch_late"):
            row[key] = sum(run_[key] for run_ in rs)
        tiers: dict[str, int] = {}
        for run_ in rs:
            for tier, n in run_["cached_tokens_by_tier"].items():
                tiers[tier] = tiers.get(tier, 0) + n
        row["cached_tokens_by_tier"] = tiers
        out[mode] = row
    return out


def _queued_disk_run(args: argparse.Namespace, parts: Any, sessions: list[list[int]],
                     mode: str, round_: int) -> dict[str, Any]:
    """Queue every session's next turn at once (disk-only prefixes), step until done."""
    from agentserving.engine.scheduler.registry import make_policy
    from testkit.worker import prompt, request

    core, store = parts.core, parts.store
    core.policy = make_policy(QUEUED_DISK_MODES[mode], 512)
    _evict_dram(store, sessions)
    prefetched: dict[int, Any] = {}  # session's first chunk int -> its prefetch's status
    fetched_at: dict[int, float] = {}  # ... -> when the engine fetched its prefix
    prefetch, fetch = store.prefetch, store.fetch_prefix

    def spy_prefetch(hashes: Any, lookup_id: Any) -> Any:
        status = prefetch(hashes, lookup_id)
        prefetched.setdefault(store.keys.int_of(hashes[0]), status)
        return status

    def spy_fetch(ints: Any, **kw: Any) -> Any:
        if ints:
            fetched_at.setdefault(ints[0], time.time())
        return fetch(ints, **kw)

    store.prefetch, store.fetch_prefix = spy_prefetch, spy_fetch
    before = dataclasses.replace(store.stats)
    core.step_records.clear()
    by_tier: dict[str, int] = {}
    try:
        for i, ids in enumerate(sessions):
            seed = 11000 + 1000 * round_ + 500 * (mode == "shadow_prefetch") + i
            core.add(request(f"qd-{mode}-{round_}-{i}", ids + prompt(args.suffix, seed=seed),
                             max_tokens=1))
        while core.has_work():
            for o in core.step():
                for tier, n in (o.meta.get("cached_tokens_by_tier") or {}).items():
                    by_tier[str(tier)] = by_tier.get(str(tier), 0) + n
            core.run_deferred()
    finally:
        del store.prefetch, store.fetch_prefix  # back to the class's methods
    recs = [r for r in core.step_records if r.prefill_tokens]
    after = store.stats
    return {
        "exposed": [r.exposed_kv_s for r in recs], "forward": [r.forward_s for r in recs],
        "turns": len(sessions), "turns_prefetched": len(prefetched),
        "prefetches_done_before_admission": sum(
            1 for first, st in prefetched.items()
            if st.state == "done" and st.finished_at is not None
            and first in fetched_at and st.finished_at <= fetched_at[first]),
        "prefetch_waits": after.prefetch_waits - before.prefetch_waits,
        "prefetch_wait_s": after.prefetch_wait_seconds - before.prefetch_wait_seconds,
        "prefetch_late": after.prefetch_late - before.prefetch_late,
        "cached_tokens_by_tier": by_tier,
    }


def decode_section(args: argparse.Namespace, bundle: Any) -> dict[str, Any]:
    from agentserving.engine.kv.paged import KVBlockPool
    from agentserving.engine.model.runner import ModelRunner
    from testkit.worker import prompt

    runner = ModelRunner(bundle)
    out: dict[str, Any] = {}
    for ctx in [int(c) for c in args.contexts.split(",")]:
        ids = prompt(ctx, seed=ctx)
        pool = KVBlockPool.for_bytes(
            (ctx + args.decode_tokens + 64) * 2 * bundle.kv_bytes_per_token,
            num_layers=bundle.num_layers, block_size=64, num_kv_heads=bundle.num_kv_heads,
            head_dim=bundle.head_dim, dtype=bundle.dtype)
        caches = {"dynamic": runner.new_cache(),
                  "paged": runner.paged_cache(pool.reserve(ctx + args.decode_tokens))}
        times: dict[str, list[float]] = {k: [] for k in caches}
        last: dict[str, torch.Tensor] = {}
        for cache in caches.values():
            for s in range(0, ctx, 2048):
                runner.forward(ids[s:s + 2048], cache, s)
        tok = 500
        for j in range(args.decode_tokens):
            for name in (("dynamic", "paged") if j % 2 else ("paged", "dynamic")):
                t0 = time.perf_counter()
                last[name] = runner.forward([tok], caches[name], ctx + j)
                times[name].append(time.perf_counter() - t0)
            assert torch.equal(last["dynamic"], last["paged"])  # same logits, bit for bit
            tok = int(last["paged"].argmax())
        d, p = stats(times["dynamic"]), stats(times["paged"])
        out[str(ctx)] = {"dynamic_s_per_token": d, "paged_s_per_token": p,
                         "p50_dynamic_over_paged": d["p50"] / p["p50"],
                         "p95_dynamic_over_paged": d["p95"] / p["p95"]}
    return out


def pull_prefix_section(args: argparse.Namespace, bundle: Any, tmp: Path) -> dict[str, Any]:
    """What reading a decode pod's local prefix costs the step loop, before and after."""
    return _on_fresh_engine(tmp / "pull", bundle, _pull_rows, args)


def _pull_rows(args: argparse.Namespace, parts: Any) -> dict[str, Any]:
    from testkit.worker import prompt, request, run

    core, store = parts.core, parts.store
    ids = prompt(args.prefix, seed=77)
    run(parts, request("seed", ids, max_tokens=1))
    hashes = store.keys.int_hashes(torch.tensor(ids), None)
    inline, add = [], []
    for i in range(max(3, args.turns // 2)):
        inline.append(store.load_prefix(hashes).seconds)  # ran inside add() before
        req = request(f"pull{i}", ids + prompt(args.suffix, seed=i), max_tokens=2)
        req.kv_transfer_params = {"do_remote_prefill": True, "remote_host": "127.0.0.1",
                                  "remote_port": 9, "transfer_id": "none"}
        t0 = time.perf_counter()
        core.add(req)  # now: hashes + queue; the read and the pull start on a thread
        add.append(time.perf_counter() - t0)
        core.abort(req.req_id)
    return {"prefix_tokens": args.prefix, "before_step_loop_s": stats(inline),
            "after_step_loop_s": stats(add)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from agentserving.engine.model.loader import load_model

    bundle = load_model("tiny")
    result: dict[str, Any] = {
        "benchmark": "kv_load",
        "host": {"machine": platform.machine(), "python": sys.version.split()[0],
                 "threads": torch.get_num_threads(), "torch": torch.__version__},
        "model": "tiny (4 layers, 4 kv heads x 64, fp32; 8 KiB of KV per token)",
        "params": {k: str(v) for k, v in vars(args).items()},
        "notes": "exposed = KV load time on the admission step's critical path (sync fetch "
                 "and verify + layer waits); forward = that step's compute without waits. "
                 "Timings from a shared 2-core host: compare modes within one run.",
    }
    sections = set(args.sections.split(","))
    with tempfile.TemporaryDirectory(prefix="kv-load-bench-") as tmp:
        if "load" in sections:
            result["load"] = load_section(args, bundle, Path(tmp))
        if "decode" in sections:
            result["decode"] = decode_section(args, bundle)
        if "pull" in sections:
            result["pull_prefix"] = pull_prefix_section(args, bundle, Path(tmp))
    report(result)
    write_result(args.out, result)
    return 0


def report(result: dict[str, Any]) -> None:
    for tier, rows in result.get("load", {}).items():
        for mode in ("layerwise", "sync"):
            if mode not in rows:
                continue
            r = rows[mode]
            print(f"load {tier:11s} {mode:9s} exposed p50 {r['exposed_kv_s']['p50'] * 1e3:7.2f} ms"
                  f" p95 {r['exposed_kv_s']['p95'] * 1e3:7.2f} ms | forward p50 "
                  f"{r['forward_s']['p50'] * 1e3:7.1f} ms p95 {r['forward_s']['p95'] * 1e3:7.1f}"
                  f" ms | exposed/forward p50 {r['exposed_p50_over_forward_p50']:.2%}")
    for mode, r in result.get("load", {}).get("queued_disk", {}).items():
        print(f"load queued_disk {mode:15s} exposed p50 {r['exposed_kv_s']['p50'] * 1e3:7.2f} ms"
              f" p95 {r['exposed_kv_s']['p95'] * 1e3:7.2f} ms | forward p50 "
              f"{r['forward_s']['p50'] * 1e3:7.1f} ms | exposed/forward p50 "
              f"{r['exposed_p50_over_forward_p50']:.2%} total "
              f"{r['exposed_total_over_forward_total']:.2%} | prefetched "
              f"{r['turns_prefetched']}/{r['turns']}, done before admission "
              f"{r['prefetches_done_before_admission']}, waited {r['prefetch_waits']}, late "
              f"{r['prefetch_late']} | forward+exposed {r['step_total_s']:.2f} s")
    for ctx, r in result.get("decode", {}).items():
        print(f"decode ctx {ctx:>6s}: dynamic {r['dynamic_s_per_token']['p50'] * 1e3:6.2f} ms"
              f" vs paged {r['paged_s_per_token']['p50'] * 1e3:6.2f} ms per token (p50)")
    pp = result.get("pull_prefix")
    if pp:
        print(f"decode pod local prefix on the step loop: before "
              f"{pp['before_step_loop_s']['p50'] * 1e3:.2f} ms, after "
              f"{pp['after_step_loop_s']['p50'] * 1e3:.2f} ms (p50)")


if __name__ == "__main__":
    sys.exit(main())
