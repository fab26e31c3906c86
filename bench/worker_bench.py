"""Worker benchmark: second-turn TTFT of a long session with its prefix in DRAM, on disk, and
recomputed, side by side; and prefill -> decode KV transfer throughput.

    python -m bench.worker_bench [--quick] [--out bench/results/worker.json]

Everything runs as real processes on loopback: ``agentserving worker --model tiny`` (an API
process + an engine process holding the random-weight Llama and LMCache's CPU and disk
tiers). Per repetition, one session:

- turn 1: a ``--context``-token prompt (16 k; 4 k with ``--quick``), 16 greedy output tokens;
- turn 2, three times, each with its own 256-token tool result appended to turn 1's prompt
  and output, so only turn 1's full chunks can be reused:
  ``dram`` (turn 1's chunks in LMCache's CPU tier), ``disk`` (evicted from DRAM through the
  memory API, so they come from the local-disk tier, checksums verified) and ``recompute``
  (evicted from every tier). TTFT is the time to the first streamed token.

P/D: a prefill worker and a decode worker; the prefill answers a ``--context``-token prompt
with ``do_remote_decode``, the decode pulls the KV (``kv_transfer_params.transfer_bytes`` /
``transfer_seconds``) and generates; its output is checked against the prefill pod's own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import finish_session_args, finish_session_bench, session_parser, wait_on_disk

NAME = "worker"
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / f"{NAME}.json"
PROG = "python -m bench.worker_bench"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = session_parser(PROG, __doc__.split("\n\n")[0], DEFAULT_OUT)
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="threads per engine process (0: torch's default)")
    args, _unknown = parser.parse_known_args(argv)
    return finish_session_args(args)


def _ttft(url: str, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """Seconds to the first streamed token, and the final usage."""
    t0 = time.perf_counter()
    first = None
    usage: dict[str, Any] = {}
    with httpx.stream("POST", url + "/v1/completions", timeout=600,
                      json={**body, "stream": True,
                            "stream_options": {"include_usage": True}}) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if first is None and event.get("choices"):
                first = time.perf_counter() - t0
            if event.get("usage"):
                usage = event["usage"]
    assert first is not None
    return first, usage


def run_ttft(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from testkit.worker import prompt, worker_process

    samples: dict[str, list[float]] = {"dram": [], "disk": [], "recompute": []}
    cached: dict[str, list[int]] = {k: [] for k in samples}
    turn1: list[float] = []
    gib = max(0.5, args.context * 8192 * 3 / 1024**3)
    with worker_process(tmp, "--torch-threads", str(args.torch_threads),
                        "--cpu-cache-gib", f"{gib:.2f}", "--disk-cache-dir", str(tmp / "kv"),
                        "--disk-cache-gib", f"{2 * gib:.2f}", "--max-model-len",
                        str(args.context + 1024), name="bench-worker",
                        timeout_s=600) as w:
        w.complete(prompt=prompt(600, seed=1), max_tokens=2)  # warm-up
        for rep in range(args.reps):
            ids = prompt(args.context, seed=1000 + rep)
            t, _ = _ttft(w.url, {"prompt": ids, "max_tokens": 1})
            turn1.append(t)
            out = w.complete(prompt=ids, max_tokens=16, return_token_ids=True)
            hashes = out["kv_transfer_params"]["chunk_hashes"]
            history = ids + out["choices"][0]["token_ids"]
            wait_on_disk(w.memory_url, hashes)
            for i, cond in enumerate(("dram", "disk", "recompute")):
                if cond != "dram":
                    evict = {"chunk_hashes": hashes}
                    if cond == "disk":
                        evict["locations"] = ["LocalCPUBackend"]
                    r = httpx.post(w.memory_url + "/memory/evict", timeout=60, json=evict)
                    r.raise_for_status()
                    assert r.json()["num_evicted"] == len(hashes), r.text
                turn2 = history + prompt(256, seed=50_000 + 10 * rep + i)
                t, usage = _ttft(w.url, {"prompt": turn2, "max_tokens": 1})
                samples[cond].append(t)
                cached[cond].append(usage["prompt_tokens_details"]["cached_tokens"])
                want = 0 if cond == "recompute" else len(hashes) * 256
                tier = {"dram": "cpu", "disk": "disk"}.get(cond)
                assert cached[cond][-1] == want, (cond, usage)
                assert tier is None or usage["prompt_tokens_details"][
                    "cached_tokens_by_tier"] == {tier: want}, (cond, usage)
                print(f"  rep {rep} {cond:9s} ttft {t * 1000:8.1f} ms  cached "
                      f"{cached[cond][-1]} of {len(turn2)}", flush=True)
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "turn2_prompt_tokens": args.context + 16 + 256,
        "ttft_s": med,
        "ttft_samples_s": samples,
        "cached_tokens": {k: v[0] for k, v in cached.items()},
        "turn1_ttft_s": statistics.median(turn1),
        "ratios": {
            "recompute_over_dram": med["recompute"] / med["dram"],
            "recompute_over_disk": med["recompute"] / med["disk"],
            "disk_over_dram": med["disk"] / med["dram"],
        },
    }


def run_pd(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from testkit.worker import prompt, worker_process

    ids = prompt(args.context, seed=7)
    body = {"prompt": ids, "max_tokens": 8, "return_token_ids": True}
    gib = max(0.5, args.context * 8192 * 2 / 1024**3)
    common = ["--torch-threads", str(args.torch_threads), "--cpu-cache-gib", f"{gib:.2f}",
              "--max-model-len", str(args.context + 1024)]
    with worker_process(tmp, "--role", "prefill", *common, name="bench-prefill",
                        timeout_s=600) as p, \
            worker_process(tmp, "--role", "decode", *common, name="bench-decode",
                           timeout_s=600) as d:
        single = p.complete(**body)
        runs = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            first = p.complete(**{**body, "max_tokens": 1,
                                  "kv_transfer_params": {"do_remote_decode": True}})
            t1 = time.perf_counter()
            t_first, _ = _ttft(d.url, {**body, "max_tokens": 1,
                                       "kv_transfer_params": first["kv_transfer_params"]})
            first = p.complete(**{**body, "max_tokens": 1,
                                  "kv_transfer_params": {"do_remote_decode": True}})
            out = d.complete(**{**body, "kv_transfer_params": first["kv_transfer_params"]})
            kvp = out["kv_transfer_params"]
            assert kvp.get("kv_source") == "remote", kvp
            runs.append({"prefill_s": t1 - t0, "decode_ttft_s": t_first,
                         "transfer_bytes": kvp["transfer_bytes"],
                         "transfer_seconds": kvp["transfer_seconds"],
                         "equal": out["choices"][0]["token_ids"]
                         == single["choices"][0]["token_ids"]})
            print(f"  pd: {kvp['transfer_bytes'] / 1e6:.1f} MB in "
                  f"{kvp['transfer_seconds'] * 1000:.1f} ms, decode ttft "
                  f"{t_first * 1000:.1f} ms", flush=True)
    secs = statistics.median(r["transfer_seconds"] for r in runs)
    nbytes = runs[0]["transfer_bytes"]
    return {
        "prompt_tokens": args.context,
        "transfer_bytes": nbytes,
        "transfer_seconds": secs,
        "throughput_mb_s": nbytes / secs / 1e6,
        "decode_ttft_s": statistics.median(r["decode_ttft_s"] for r in runs),
        "prefill_s": statistics.median(r["prefill_s"] for r in runs),
        "decode_equals_single_pod": all(r["equal"] for r in runs),
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="worker-bench-") as tmp:
        print(f"worker bench: context {args.context} tokens, {args.reps} rep(s)", flush=True)
        ttft = run_ttft(args, Path(tmp))
        pd = run_pd(args, Path(tmp))
    r = ttft["ratios"]
    print(f"second-turn TTFT (median of {args.reps}): dram {ttft['ttft_s']['dram'] * 1000:.0f} "
          f"ms, disk {ttft['ttft_s']['disk'] * 1000:.0f} ms, recompute "
          f"{ttft['ttft_s']['recompute'] * 1000:.0f} ms -> recompute/dram "
          f"{r['recompute_over_dram']:.1f}x, recompute/disk {r['recompute_over_disk']:.1f}x, "
          f"disk/dram {r['disk_over_dram']:.2f}x")
    print(f"P->D transfer: {pd['transfer_bytes'] / 1e6:.1f} MB at "
          f"{pd['throughput_mb_s']:.0f} MB/s; decode equals single pod: "
          f"{pd['decode_equals_single_pod']}")
    return finish_session_bench(NAME, args, ttft, pd, started,
                                {"torch_threads": args.torch_threads or "default"},
                                model="tiny (random-weight Llama: 4 layers, hidden 256, fp32)")


if __name__ == "__main__":
    sys.exit(main())
