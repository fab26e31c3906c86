"""The proxy's added latency per turn, with one prefill pod and with four, side by side with a
direct call to a worker, all interleaved in one run so machine noise hits every path alike.

Paths (each a proxy process in front of the same workers, the same session's turns):
- ``direct``: straight to worker w0, no proxy.
- ``kv-aware-1``: one prefill pod; nothing to choose, so no lookup is made.
- ``round-robin-4``: four pods, no KV awareness (never asks the kvindex).
- ``kv-aware-4``: four pods, every turn looked up in the proxy's in-process residency replica
  (the default).
- ``kv-aware-4-kvindex``: four pods, every turn looked up with a kvindex round trip
  (``--no-residency-replica``: the proxy without its replica).

Added latency is the difference to ``direct`` pair by pair (turn i of a path minus turn i of
direct); the aim is under 1 ms at P50 with four prefill pods. The workers are stand-ins
by default (``bench/standin_worker.py``: they hash, register and publish residency as workers
do, and answer at once), so the proxy's own cost is not lost in the model's: with real tiny
workers (``--workers reference``) every path takes ~28 ms on 2 cores and the pairwise
differences scatter by a millisecond either way.

    python -m bench proxy [--quick] [--turns N] [--out bench/results/proxy.json]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import add_run_args, percentile, progress, write_result
from testkit.servers import AGENTSERVING, free_port, free_port_run, service_process

WORKERS = ("w0", "w1", "w2", "w3")
# path -> (prefill pods, proxy flags)
PATHS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "kv-aware-1": (WORKERS[:1], ("--routing", "kv-aware")),
    "round-robin-4": (WORKERS, ("--routing", "round-robin")),
    "kv-aware-4": (WORKERS, ("--routing", "kv-aware")),
    "kv-aware-4-kvindex": (WORKERS, ("--routing", "kv-aware", "--no-residency-replica")),
}
TARGET_PATH = "kv-aware-4"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench proxy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=300, help="Turns per path.")
    parser.add_argument("--prompt-tokens", type=int, default=256,
                        help="Prompt length of every turn (one chunk: cached after warm-up).")
    parser.add_argument("--workers", choices=("reference", "standin"), default="standin",
                        help="reference: real workers (the tiny model) whose compute is part "
                             "of every path; standin: bench/standin_worker.py, answering at "
                             "once, so the proxy's own cost is not lost in the model's noise.")
    add_run_args(parser, "20 turns", Path("bench/results/proxy.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.turns = 20
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        logs = Path(tmp)
        kv_port = free_port()
        kvindex = f"http://127.0.0.1:{kv_port}"
        stack.enter_context(service_process(
            [AGENTSERVING, "kvindex", "--port", str(kv_port), "--log-level", "warning"],
            kvindex + "/readyz", log_path=logs / "kvindex.log"))
        workers = {}
        for name in WORKERS:
            port = free_port()
            workers[name] = f"http://127.0.0.1:{port}"
            stack.enter_context(service_process(
                worker_command(args.workers, name, port, kvindex), workers[name] + "/readyz",
                log_path=logs / f"worker-{name}.log", timeout_s=180))
        paths = {"direct": workers["w0"]}
        for name, (pods, flags) in PATHS.items():
            port = free_port()
            paths[name] = f"http://127.0.0.1:{port}"
            prefill = [arg for pod in pods for arg in ("--prefill", workers[pod])]
            stack.enter_context(service_process(
                [AGENTSERVING, "proxy", "--port", str(port), "--kvindex", kvindex, *prefill,
                 *flags, "--log-level", "warning"], paths[name] + "/readyz",
                log_path=logs / f"proxy-{name}.log"))
        samples, metrics = measure(paths, args)
    return report(samples, metrics, args)


def worker_command(kind: str, name: str, port: int, kvindex: str) -> list[str]:
    if kind == "standin":  # run as a script: the repository root would shadow ``operator``
        return [sys.executable, str(Path(__file__).with_name("standin_worker.py")), "--port",
                str(port), "--pod-name", name, "--kvindex", kvindex, "--max-output-tokens", "1"]
    return [AGENTSERVING, "worker", "--port", str(port), "--memory-port-start",
            str(free_port_run(2)), "--pod-name", name, "--kvindex", kvindex, "--cpu-cache-gib",
            "0.25", "--torch-threads", "1", "--log-level", "warning"]


def measure(paths: dict[str, str], args: argparse.Namespace
            ) -> tuple[dict[str, list[float]], dict[str, str]]:
    prompt = list(range(10, 10 + args.prompt_tokens))
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
    headers = {"x-session-id": "bench"}
    samples: dict[str, list[float]] = {name: [] for name in paths}
    with httpx.Client(timeout=60) as http:
        for url in paths.values():  # warm every path and pod: the prompt is cached everywhere
            for _ in range(2 * len(WORKERS)):
                http.post(url + "/v1/completions", json=body, headers=headers
                          ).raise_for_status()
        time.sleep(1.0)  # the warm-up's residency reaches the kvindex and the replicas
        with progress(not args.no_progress) as bar:
            task = bar.add_task("proxy bench: turns per path", total=args.turns)
            for _ in range(args.turns):
                for name, url in paths.items():  # interleaved: noise hits every path alike
                    start = time.perf_counter()
                    http.post(url + "/v1/completions", json=body, headers=headers
                              ).raise_for_status()
                    samples[name].append((time.perf_counter() - start) * 1e3)
                bar.advance(task)
        metrics = {name: http.get(url + "/metrics").text for name, url in paths.items()
                   if name != "direct"}
    return samples, metrics


def report(samples: dict[str, list[float]], metrics: dict[str, str],
           args: argparse.Namespace) -> int:
    direct = samples["direct"]
    out: dict = {"turns": args.turns, "prompt_tokens": args.prompt_tokens,
                 "workers": args.workers,
                 "paths": {}, "added_ms": {}, "ratios": {}, "routing_p50_ms_bucket": {},
                 "lookups": {}}
    for name, values in samples.items():
        out["paths"][name] = {"p50_ms": percentile(values, 0.5),
                              "p99_ms": percentile(values, 0.99)}
        if name == "direct":
            continue
        added = [p - d for p, d in zip(values, direct, strict=True)]
        out["added_ms"][name] = {"p50": statistics.median(added), "p99": percentile(added, 0.99)}
        out["ratios"][f"{name}_over_direct_p50"] = percentile(values, 0.5) / percentile(direct,
                                                                                        0.5)
        out["routing_p50_ms_bucket"][name] = _routing_p50_ms(metrics[name])
        out["lookups"][name] = _lookups(metrics[name])
    out["ratios"]["kv-aware-4_added_p50_over_kvindex_round_trip"] = (
        out["added_ms"][TARGET_PATH]["p50"] / out["added_ms"]["kv-aware-4-kvindex"]["p50"]
        if out["added_ms"]["kv-aware-4-kvindex"]["p50"] > 0 else None)
    out["target"] = {"path": TARGET_PATH, "added_p50_ms_max": 1.0,
                     "met": out["added_ms"][TARGET_PATH]["p50"] < 1.0}
    print(f"{'path':<20}{'p50 ms':>9}{'p99 ms':>9}{'added p50':>11}{'added p99':>11}"
          f"{'lookups (replica/kvindex)':>28}")
    for name, r in out["paths"].items():
        added = out["added_ms"].get(name, {"p50": 0.0, "p99": 0.0})
        looked = out["lookups"].get(name, {})
        print(f"{name:<20}{r['p50_ms']:>9.2f}{r['p99_ms']:>9.2f}{added['p50']:>11.2f}"
              f"{added['p99']:>11.2f}"
              f"{looked.get('replica', 0):>14.0f} / {looked.get('kvindex', 0):<11.0f}")
    print(f"target: {TARGET_PATH} adds < 1 ms at P50: "
          f"{'met' if out['target']['met'] else 'NOT met'}")
    write_result(args.out, out)
    return 0


def _samples(metrics_text: str, name: str) -> list[tuple[str, float]]:
    """(label text, value) of every sample of ``name``."""
    out = []
    for line in metrics_text.splitlines():
        if line.startswith(name):
            key, _, value = line.rpartition(" ")
            out.append((key[len(name):], float(value)))
    return out


def _lookups(metrics_text: str) -> dict[str, float]:
    return {labels.split('"')[1]: value
            for labels, value in _samples(metrics_text, "proxy_kv_lookups_total{")}


def _routing_p50_ms(metrics_text: str) -> float | None:
    """The upper bound of the histogram bucket holding the median routing time."""
    buckets = [(float("inf") if labels.split('"')[1] == "+Inf" else float(labels.split('"')[1]),
                value) for labels, value in _samples(metrics_text, "proxy_routing_seconds_bucket")]
    count = dict(_samples(metrics_text, "proxy_routing_seconds_count")).get("")
    if not count:
        return None
    return next(le * 1e3 for le, c in sorted(buckets) if c >= count / 2)


if __name__ == "__main__":
    sys.exit(main())
