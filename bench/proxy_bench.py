"""The proxy's added latency per turn: the same turns sent straight to a worker, through a
proxy that routes without the kvindex (round-robin), and through one that looks every turn up
(kv-aware), interleaved in one run so machine noise hits all alike. Two workers, so kv-aware
has a choice to make and asks the kvindex every turn (with one prefill pod the proxy skips the
lookup). Issue 5 aims for under 1 ms added at P50.

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

from agentserving.core.testing import free_port, free_port_run, service_process
from bench.common import percentile, write_result

AGENTSERVING = str(Path(sys.executable).parent / "agentserving")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench proxy", description=__doc__)
    parser.add_argument("--turns", type=int, default=300, help="Turns per path.")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--quick", action="store_true", help="Smoke sizes (CI).")
    parser.add_argument("--out", type=Path, default=Path("bench/results/proxy.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.turns = 20
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        kv_port, w_port, mem = free_port(), free_port(), free_port_run(2)
        kvindex = f"http://127.0.0.1:{kv_port}"
        paths = {"direct": f"http://127.0.0.1:{w_port}"}
        stack.enter_context(service_process(
            [AGENTSERVING, "kvindex", "--port", str(kv_port), "--log-level", "warning"],
            kvindex + "/readyz", log_path=Path(tmp) / "kvindex.log"))
        # two workers: with one, kv-aware has nothing to choose and skips the lookup
        for name, port, mem_port in (("w0", w_port, mem), ("w1", free_port(), free_port_run(2))):
            stack.enter_context(service_process(
                [AGENTSERVING, "worker", "--port", str(port), "--memory-port-start",
                 str(mem_port), "--pod-name", name, "--kvindex", kvindex, "--cpu-cache-gib",
                 "0.25", "--log-level", "warning"], f"http://127.0.0.1:{port}/readyz",
                log_path=Path(tmp) / f"worker-{name}.log", timeout_s=180))
        # round-robin never asks the kvindex: the difference to kv-aware is the lookup's cost
        for routing in ("round-robin", "kv-aware"):
            port = free_port()
            paths[routing] = f"http://127.0.0.1:{port}"
            stack.enter_context(service_process(
                [AGENTSERVING, "proxy", "--port", str(port), "--kvindex", kvindex,
                 "--routing", routing, "--log-level", "warning"], paths[routing] + "/readyz",
                log_path=Path(tmp) / f"proxy-{routing}.log"))
        prompt = list(range(10, 10 + args.prompt_tokens))
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
        headers = {"x-session-id": "bench"}
        samples: dict[str, list[float]] = {name: [] for name in paths}
        with httpx.Client(timeout=60) as http:
            for url in paths.values():  # warm every path; the session's KV is now cached
                for _ in range(3):
                    http.post(url + "/v1/completions", json=body,
                              headers=headers).raise_for_status()
            for _ in range(args.turns):  # interleaved, so noise hits every path alike
                for name, url in paths.items():
                    start = time.perf_counter()
                    http.post(url + "/v1/completions", json=body, headers=headers
                              ).raise_for_status()
                    samples[name].append((time.perf_counter() - start) * 1e3)
            routing_ms = _routing_p50_ms(http.get(paths["kv-aware"] + "/metrics").text)
    direct = samples["direct"]
    report: dict = {"turns": args.turns, "prompt_tokens": args.prompt_tokens, "paths": {},
                    "added_ms": {}, "ratios": {},
                    "proxy_routing_p50_ms_bucket": routing_ms}
    for name, values in samples.items():
        report["paths"][name] = {"p50_ms": percentile(values, 0.5),
                                 "p99_ms": percentile(values, 0.99)}
        if name != "direct":
            added = [p - d for p, d in zip(values, direct, strict=True)]
            report["added_ms"][name] = {"p50": statistics.median(added),
                                        "p99": percentile(added, 0.99)}
            report["ratios"][f"{name}_over_direct_p50"] = (percentile(values, 0.5)
                                                           / percentile(direct, 0.5))
    report["target"] = {"added_p50_ms_max": 1.0,
                        "met": report["added_ms"]["kv-aware"]["p50"] < 1.0}
    print(f"{'path':<14}{'p50 ms':>10}{'p99 ms':>10}{'added p50':>12}")
    for name, r in report["paths"].items():
        added_p50 = report["added_ms"].get(name, {}).get("p50", 0.0)
        print(f"{name:<14}{r['p50_ms']:>10.2f}{r['p99_ms']:>10.2f}{added_p50:>12.2f}")
    write_result(args.out, report)
    return 0


def _routing_p50_ms(metrics_text: str) -> float | None:
    """The upper bound of the histogram bucket holding the median routing time."""
    buckets, count = [], None
    for line in metrics_text.splitlines():
        if line.startswith("proxy_routing_seconds_bucket"):
            le = line.split('le="')[1].split('"')[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.split()[-1])))
        elif line.startswith("proxy_routing_seconds_count"):
            count = float(line.split()[-1])
    if not count:
        return None
    return next(le * 1e3 for le, c in sorted(buckets) if c >= count / 2)


if __name__ == "__main__":
    sys.exit(main())
