"""`agentserving sim calibrate`: fit a profile to the reference engine on this machine.

Measured in-process, briefly (what bench/prefill_sched_bench.py's calibration repeats), each
piece of work the engine's step loop does, on the engine's own paged KV pool (``engine.kv.paged``:
forwards read and write its blocks, loads and stores copy between them and LMCache, as the
worker does; a ``DynamicCache`` re-copies the whole context on every decoded token):
- prefill forwards of the model runner (``--model tiny`` by default) over chunks of several
  sizes and starts -> ``a + b*new + c*start + d*pairs`` (the ShadowScheduler's own
  ``StepTimeModel`` with its attention term: a chunk's cost grows with new x context);
- one-token decode forwards over contexts -> per-sequence ``b + c*context`` (the reference
  engine decodes a batch one request after another, so ``a`` = 0);
- LMCache loads per chunk from DRAM and from disk, and stores of new chunks -> the
  DRAM->device, disk->DRAM and device->DRAM bandwidths (loads and stores run on the loop);
- the P/D hand-off wire (encode + framed, checksummed decode) -> the pod-to-pod bandwidth.
The profile also states the host's cores (all pods of a local fleet share them) and the
worker's default scheduler. ``--from-run DIR/report.json`` takes the host's cores from a real
bench run and records its worker figures beside the measurements.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from agentserving.core.hashing import DEFAULT_CHUNK_SIZE
from agentserving.prefill.shadow import StepTimeModel
from agentserving.sim.profile import Profile


def cpu_clock() -> float:
    """This thread's CPU seconds. Every forward, store and wire pass runs on the calling thread
    (one torch thread), so its CPU time is what it takes standalone, however busy the machine
    is while calibrating; sharing the cores is the simulator's job (``Profile.host_cores``).
    (Disk loads wait on I/O and are timed by the store itself, on the wall clock.)"""
    return time.thread_time()


def measure(model_name: str = "tiny", quick: bool = True) -> dict[str, Any]:
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    import torch

    from agentserving.engine.builder import build_engine
    from agentserving.engine.model.tokenizer import synthetic_ids as prompt
    from agentserving.engine.settings import WorkerSettings

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="sim-calibrate-"))
    parts = build_engine(WorkerSettings(cpu_cache_gib=0.25, disk_cache_dir=tmp / "disk",
                                        disk_cache_gib=0.5, pod_name="calibrate",
                                        model=model_name, kv_cache_gib=0.25))
    runner = parts.runner
    cfg = runner.config
    pool = parts.core.pool
    held: list[Any] = []

    starts = [0, 1024, 2048] if quick else [0, 1024, 2048, 3072]
    ids = prompt(starts[-1] + 2048, seed=1)   # every (start, n) row gets all n new tokens

    def new_cache(tokens: int = len(ids) + 64) -> Any:
        """A request's cache over the engine's pool (blocks for ``tokens``), as the engine
        makes one at admission; the previous one's blocks go back first."""
        while held:
            held.pop().release()
        kv = pool.reserve(tokens)
        if kv is None:
            raise RuntimeError(f"calibrate: KV pool too small for {tokens} tokens")
        held.append(kv)
        return runner.paged_cache(kv, 0, None)

    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    dtype_bytes = next(runner.model.parameters()).element_size()
    kv_bytes = 2 * cfg.num_hidden_layers * kv_heads * head_dim * dtype_bytes
    runner.forward(ids[:256], new_cache(), 0)  # warm
    # prefill cost has an attention term: a chunk of n tokens at start reads start tokens of
    # KV per query (n * (start + (n + 1) / 2) pairs); fitted with the shadow's own model
    pre = StepTimeModel(min_samples=3, attention=True)
    rows = []
    for start in starts:
        for n in [256, 512, 1024, 2048]:
            cache = new_cache()
            if start:
                runner.forward(ids[:start], cache, 0)
            t0 = cpu_clock()
            runner.forward(ids[start:start + n], cache, start)
            sec = cpu_clock() - t0
            rows.append({"new_tokens": n, "context_tokens": start, "seconds": sec})
            pre.observe(n, start, sec)
    pre.fit()
    dec_rows = []
    for ctx in ([256, 2048] if quick else [256, 1024, 2048, 3072]):
        cache = new_cache()
        runner.forward(ids[:ctx], cache, 0)
        secs = []
        for j in range(5):
            t0 = cpu_clock()
            runner.forward(ids[ctx + j:ctx + j + 1], cache, ctx + j)
            secs.append(cpu_clock() - t0)
        dec_rows.append({"context_tokens": ctx, "seconds": float(np.median(secs))})
    x = np.column_stack([np.ones(len(dec_rows)), [r["context_tokens"] for r in dec_rows]])
    dcoef, *_ = np.linalg.lstsq(x, [r["seconds"] for r in dec_rows], rcond=None)
    dcoef = np.maximum(dcoef, 0.0)
    # KV load per 256-token chunk from DRAM and disk (the real LMCache tiers)
    store, keys = parts.store, parts.keys
    toks = prompt(1024 + 1, seed=2)
    cache = new_cache()
    runner.forward(toks[:1024], cache, 0)
    store.store(toks, None, 0, None, paged=cache.paged_kv)
    store.wait_disk_writes()
    ints = [keys.to_int(h) for h in keys.hasher(None).raw_hashes(toks)][:4]

    def load_s() -> float:
        """Seconds to read the 4 chunks and copy them into a request's blocks (the engine's
        non-overlapped path; with layer-wise loads the copy can hide behind the forward)."""
        new_cache()
        fetched = store.fetch_prefix(ints, paged=held[0])
        assert fetched.num_tokens == 1024, fetched.num_tokens
        return fetched.seconds

    # wall clock (a disk read waits on I/O): the fastest of several, as on a quiet host
    cpu_s = min(load_s() for _ in range(7)) / 4
    wires = [keys.wire_of_int(v) for v in ints]
    disk = []
    for _ in range(7):
        store.evict(wires, store.resolve_locations(["cpu"]))
        disk.append(load_s() / 4)
    # storing newly computed chunks (the engine's deferred store after a prefill, and a decode
    # pod keeping a pulled prompt): seconds per chunk, fresh tokens each time
    store_s = []
    for seed in (3, 4, 5):
        toks = prompt(1024 + 1, seed=seed)
        cache = new_cache()
        runner.forward(toks[:1024], cache, 0)
        t0 = cpu_clock()
        store.store(toks, None, 0, None, paged=cache.paged_kv)
        store_s.append((cpu_clock() - t0) / 4)
    store.wait_disk_writes()
    wire = _wire_seconds(runner.cache_layers(cache), cfg, kv_heads, head_dim)
    while held:
        held.pop().release()
    parts.close()
    return {"model": model_name, "kv_bytes_per_token": kv_bytes, "prefill_rows": rows,
            "prefill_coef": [float(v) for v in pre.coef], "decode_rows": dec_rows,
            "decode_coef": [float(v) for v in dcoef],
            "kv_load_s_per_chunk": {"cpu": cpu_s, "disk": min(disk)},
            "kv_store_s_per_chunk": float(np.median(store_s)),
            "handoff_wire": wire, "host_cores": os.cpu_count() or 1}


def _wire_seconds(layers: Any, cfg: Any, kv_heads: int, head_dim: int) -> dict[str, float]:
    """The P/D hand-off's own CPU cost: a 1024-token prompt's KV encoded as the prefill pod
    streams it and decoded (framing, blake3 per frame, tensors) as the decode pod does, in
    64 KiB reads: bytes per second of both ends together (the loopback socket not included)."""
    from agentserving.decode.handoff.wire import Decoder, dtype_name, encode

    k0 = layers[0][0]
    header = {"model": "calibrate", "num_tokens": int(k0.shape[2]),
              "num_layers": len(layers), "num_kv_heads": kv_heads, "head_dim": head_dim,
              "dtype": dtype_name(k0.dtype)}
    best = float("inf")
    nbytes = 0
    for _ in range(3):
        t0 = cpu_clock()
        stream = b"".join(bytes(p) for p in encode(header, list(layers)))
        dec = Decoder()
        for i in range(0, len(stream), 1 << 16):
            dec.feed(stream[i:i + (1 << 16)])
        best = min(best, cpu_clock() - t0)
        nbytes = len(stream)
    return {"bytes": nbytes, "seconds": best}


def from_run(report_path: Path) -> dict[str, float]:
    """What a real bench run says about its host and workers: the cores every process shared
    (``machine.cpus``), and for reference the hand-off bytes over decode-side TTFT and the
    decode pods' time per output token (these include queueing and the host's contention,
    which the simulator models itself, so they are recorded, not folded into the profile)."""
    report = json.loads(Path(report_path).read_text())
    recv = ttft = tpot = tpot_n = 0.0
    for m in report["configs"].get("agentserving", {}).get("workers", {}).values():
        got = m.get("transfer_bytes_total{direction=received}", 0.0)
        if got:
            recv += got
            ttft += m.get("ttft_seconds_sum", 0.0)
            tpot += m.get("time_per_output_token_seconds_sum", 0.0)
            tpot_n += m.get("time_per_output_token_seconds_count", 0.0)
    out: dict[str, float] = {}
    if report.get("machine", {}).get("cpus"):
        out["cpus"] = int(report["machine"]["cpus"])
    if recv and ttft:
        out["handoff_bytes_per_decode_ttft_gbps"] = recv / ttft / 1e9
    if tpot_n:
        out["time_per_output_token_s"] = tpot / tpot_n
    return out


def build_profile(m: dict[str, Any], run: dict[str, float] | None = None,
                  name: str = "reference-cpu", chunk: int = DEFAULT_CHUNK_SIZE) -> Profile:
    from agentserving.engine.settings import WorkerSettings

    a, b, c, d = m["prefill_coef"]
    d0, dc = m["decode_coef"]
    chunk_bytes = chunk * m["kv_bytes_per_token"]
    cpu_gbps = chunk_bytes / max(m["kv_load_s_per_chunk"]["cpu"], 1e-9) / 1e9
    disk_extra = max(m["kv_load_s_per_chunk"]["disk"] - m["kv_load_s_per_chunk"]["cpu"], 1e-9)
    store_gbps = chunk_bytes / max(m["kv_store_s_per_chunk"], 1e-9) / 1e9
    wire = m["handoff_wire"]
    run = run or {}
    cores = int(run.get("cpus") or m["host_cores"])
    fields = WorkerSettings.model_fields
    engine = {"scheduler": fields["scheduler_policy"].default,
              "prefill_chunk_tokens": fields["prefill_chunk_tokens"].default,
              "max_running": fields["max_running_requests"].default}
    assumptions = ["hbm_kv_gib: the reference engine keeps running KV in process memory; "
                   "4 GiB is an assumed bound (not reached by the bundled workload)",
                   "device_cache_fraction 0: the reference engine reuses KV through LMCache's "
                   "CPU tier only (no device prefix cache)",
                   "dram 2 GiB, ssd 4 GiB: agentserving compare's default tier sizes",
                   f"host_cores {cores}: every pod of a local fleet is a process on this "
                   "machine; busy engine loops share its cores (the proxy, kvindex, API "
                   "processes and the client are not charged)",
                   "pod_to_pod: the hand-off wire's encode + decode CPU throughput (loopback "
                   "socket not included)",
                   "engine: the worker's default scheduler flags (what agentserving compare runs)"]
    measured: dict[str, Any] = {"runner": m}
    if run:
        measured["from_run"] = run
    return Profile(
        name=name, accelerator=f"CPU (this machine, {cores} cores, 1 torch thread per worker)",
        model=m["model"], kv_bytes_per_token=m["kv_bytes_per_token"],
        prefill={"a_s": a, "b_s": b, "c_s": c, "d_s": d},
        decode={"a_s": 0.0, "b_s": d0, "c_s": dc},
        memory={"hbm_kv_gib": 4.0, "dram_gib": 2.0, "ssd_gib": 4.0,
                "device_cache_fraction": 0.0},
        bandwidth={"disk_to_dram_gbps": chunk_bytes / disk_extra / 1e9,
                   "dram_to_device_gbps": cpu_gbps,
                   "pod_to_pod_gbps": wire["bytes"] / wire["seconds"] / 1e9,
                   "device_to_dram_gbps": store_gbps},
        max_running=engine["max_running"], step_tokens=8192, host_cores=cores, engine=engine,
        source="measured by `agentserving sim calibrate` on this machine"
               + (" (+ the host of a real bench run)" if run else ""),
        assumptions=assumptions, measured=measured)
