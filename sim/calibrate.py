"""`agentserving sim calibrate`: fit a profile to the reference engine on this machine.

Measured in-process, briefly (the same approach as bench/prefill_sched_bench.py, part 1): the
reference engine's model runner (``--model tiny`` by default) over prefill chunks of several
sizes and contexts -> ``a + b*new + c*context`` by least squares (the ShadowScheduler's own
``StepTimeModel``); one-token decode forwards over contexts -> per-sequence ``b + c*context``
(the reference engine decodes a batch one request after another, so ``a`` = 0); LMCache load
seconds per chunk from DRAM and from disk -> the DRAM->device and disk->DRAM bandwidths.

Optionally (``--from-run DIR/report.json``) two engine-level costs the runner alone does not
show are taken from a real ``agentserving bench`` run's worker metrics: the P/D hand-off
bandwidth (bytes received / decode-side TTFT seconds) and the per-token decode overhead
(time_per_output_token minus the runner's forward). The profile records which is which.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from agentserving.prefill.shadow import StepTimeModel
from agentserving.sim.profile import Profile


def measure(model_name: str = "tiny", quick: bool = True) -> dict[str, Any]:
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    import torch

    from agentserving.engine.builder import build_engine
    from agentserving.engine.settings import WorkerSettings
    from agentserving.engine.testing import prompt

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="sim-calibrate-"))
    parts = build_engine(WorkerSettings(cpu_cache_gib=0.25, disk_cache_dir=tmp / "disk",
                                        disk_cache_gib=0.5, pod_name="calibrate",
                                        model=model_name))
    runner = parts.runner
    cfg = runner.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    dtype_bytes = next(runner.model.parameters()).element_size()
    kv_bytes = 2 * cfg.num_hidden_layers * kv_heads * head_dim * dtype_bytes
    ids = prompt(4096, seed=1)
    runner.forward(ids[:256], runner.new_cache(), 0)  # warm
    pre = StepTimeModel(min_samples=3)
    rows = []
    for start in ([0, 1024] if quick else [0, 1024, 2048]):
        for n in ([256, 1024, 2048] if quick else [256, 512, 1024, 2048]):
            cache = runner.new_cache()
            if start:
                runner.forward(ids[:start], cache, 0)
            t0 = time.perf_counter()
            runner.forward(ids[start:start + n], cache, start)
            sec = time.perf_counter() - t0
            rows.append({"new_tokens": n, "context_tokens": start, "seconds": sec})
            pre.observe(n, start, sec)
    pre.fit()
    dec_rows = []
    for ctx in ([256, 2048] if quick else [256, 1024, 2048, 3072]):
        cache = runner.new_cache()
        runner.forward(ids[:ctx], cache, 0)
        secs = []
        for j in range(5):
            t0 = time.perf_counter()
            runner.forward(ids[ctx + j:ctx + j + 1], cache, ctx + j)
            secs.append(time.perf_counter() - t0)
        dec_rows.append({"context_tokens": ctx, "seconds": float(np.median(secs))})
    x = np.column_stack([np.ones(len(dec_rows)), [r["context_tokens"] for r in dec_rows]])
    dcoef, *_ = np.linalg.lstsq(x, [r["seconds"] for r in dec_rows], rcond=None)
    dcoef = np.maximum(dcoef, 0.0)
    # KV load per 256-token chunk from DRAM and disk (the real LMCache tiers)
    store, keys = parts.store, parts.keys
    toks = prompt(1024 + 1, seed=2)
    cache = runner.new_cache()
    runner.forward(toks[:1024], cache, 0)
    store.store(toks, runner.cache_layers(cache), 0, None)
    store.wait_disk_writes()
    ints = [keys.to_int(h) for h in keys.hasher(None).raw_hashes(toks)][:4]
    cpu_s = min(store.load_prefix(ints).seconds for _ in range(3)) / 4
    wires = [keys.wire_of_int(v) for v in ints]
    disk = []
    for _ in range(3):
        store.evict(wires, store.resolve_locations(["cpu"]))
        disk.append(store.load_prefix(ints).seconds / 4)
    parts.close()
    return {"model": model_name, "kv_bytes_per_token": kv_bytes, "prefill_rows": rows,
            "prefill_coef": [float(v) for v in pre.coef], "decode_rows": dec_rows,
            "decode_coef": [float(v) for v in dcoef],
            "kv_load_s_per_chunk": {"cpu": cpu_s, "disk": min(disk)}}


def from_run(report_path: Path) -> dict[str, float]:
    """P/D hand-off bandwidth and per-token decode time from a real bench run's workers."""
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
    if recv and ttft:
        out["pod_to_pod_gbps"] = recv / ttft / 1e9
    if tpot_n:
        out["time_per_output_token_s"] = tpot / tpot_n
    return out


def build_profile(m: dict[str, Any], run: dict[str, float] | None = None,
                  name: str = "reference-cpu", chunk: int = 256) -> Profile:
    a, b, c = m["prefill_coef"]
    d0, dc = m["decode_coef"]
    chunk_bytes = chunk * m["kv_bytes_per_token"]
    cpu_gbps = chunk_bytes / max(m["kv_load_s_per_chunk"]["cpu"], 1e-9) / 1e9
    disk_extra = max(m["kv_load_s_per_chunk"]["disk"] - m["kv_load_s_per_chunk"]["cpu"], 1e-9)
    assumptions = ["hbm_kv_gib: the reference engine keeps running KV in process memory; "
                   "4 GiB is an assumed bound (not reached by the bundled workload)",
                   "device_cache_fraction 0: the reference engine reuses KV through LMCache's "
                   "CPU tier only (no device prefix cache)",
                   "dram 2 GiB, ssd 4 GiB: agentserving bench's default tier sizes"]
    measured = {"runner": m}
    run = run or {}
    p2p = run.get("pod_to_pod_gbps")
    if p2p is None:
        p2p = 0.05
        assumptions.append("pod_to_pod 0.05 GB/s: assumed (HTTP hand-off on loopback); "
                           "pass --from-run to fit it")
    d_b = d0
    if run.get("time_per_output_token_s"):
        d_b = max(d0, run["time_per_output_token_s"] - dc * 2048)
        measured["from_run"] = run
    return Profile(
        name=name, accelerator="CPU (this machine, 1 torch thread per worker)",
        model=m["model"], kv_bytes_per_token=m["kv_bytes_per_token"],
        prefill={"a_s": a, "b_s": b, "c_s": c},
        decode={"a_s": 0.0, "b_s": d_b, "c_s": dc},
        memory={"hbm_kv_gib": 4.0, "dram_gib": 2.0, "ssd_gib": 4.0,
                "device_cache_fraction": 0.0},
        bandwidth={"disk_to_dram_gbps": chunk_bytes / disk_extra / 1e9,
                   "dram_to_device_gbps": cpu_gbps, "pod_to_pod_gbps": p2p},
        max_running=64, step_tokens=8192,
        source="measured by `agentserving sim calibrate` on this machine"
               + (" + worker metrics of a real bench run" if run else ""),
        assumptions=assumptions, measured=measured)
