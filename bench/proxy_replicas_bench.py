"""Three proxy replicas, each session's turns sent round-robin across them: how do they keep
routing a session to its KV? Two ways, and which is better:

- ``shared``: ``--shared-sessions``, each session's routing record kept in the kvindex (one
  kvindex read before a turn, one write after it);
- ``prompt-hash``: ``--prompt-hash-scheme blake3``, no session state at all: the proxy hashes
  the request's own prompt (token ids) and looks those chunks up (in its residency replica),
  as llm-d's precise router does.

Against ``one``, a single proxy (what the replicas should equal), and ``plain``, three replicas
with neither (each routes a turn it never saw the session of by the session's rendezvous pod).
Same workload for each, on a fleet of its own: ``--sessions`` agent sessions of ``--turns``
turns (a long first turn, short appends, think time between) on stand-in pods
(``bench/standin_worker.py``: they hash, publish residency and report cached tokens as a worker
does, taking ``--us-per-token`` per prompt token they compute), so what differs is the routing
alone. The first turns run on one pod; then a second pod joins (a scale-out) and the rest
follow. Half the sessions' ids now hash to the new pod, which is all a replica that never saw
a session has to go by; their KV is on the old one.

Per configuration: the share of later turns that ran on the pod holding the session's previous
turn, the prompt tokens served from cache, and each turn's latency through the proxy.

    python -m bench proxy_replicas [--quick] [--sessions N] [--out PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.agent_load import add_workload_args
from bench.common import add_run_args, percentile, progress, write_result
from testkit.servers import AGENTSERVING, free_port, service_process

STANDIN = str(Path(__file__).with_name("standin_worker.py"))
CHUNK = 256
REPLICAS = 3
CONFIGS: dict[str, tuple[int, tuple[str, ...]]] = {  # name -> (proxies, proxy flags)
    "one": (1, ()),
    "plain": (REPLICAS, ()),
    "shared": (REPLICAS, ("--shared-sessions",)),
    "prompt-hash": (REPLICAS, ("--prompt-hash-scheme", "blake3")),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench proxy_replicas", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=60, help="Agent sessions per config.")
    add_workload_args(parser, turns=6, first_tokens=3000, append_tokens=300)
    parser.add_argument("--ramp-s", type=float, default=0.2,
                        help="Sessions start within this many seconds (their first turns "
                             "overlap and are spread by load).")
    parser.add_argument("--think-s", type=float, default=1.0,
                        help="Mean seconds between a session's turns (0.5x-1.5x).")
    parser.add_argument("--us-per-token", type=float, default=20.0,
                        help="Microseconds a stand-in takes per prompt token it computes: "
                             "first turns keep a pod busy, so the proxy spreads them by load "
                             "and a session's pod is often not its rendezvous pod.")
    parser.add_argument("--seed", type=int, default=18, help="Random seed.")
    add_run_args(parser, "8 sessions", Path("bench/results/proxy_replicas.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.sessions, args.turns, args.think_s = 8, 4, 0.2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as tmp, progress(not args.no_progress) as bar:
        for k, (config, (count, flags)) in enumerate(CONFIGS.items()):
            task = bar.add_task(f"{config}: turns", total=args.sessions * args.turns)
            logs = Path(tmp) / config
            logs.mkdir()
            with contextlib.ExitStack() as stack:
                fleet = Fleet(stack, logs, args)
                urls = [fleet.start_proxy(f"{config}-{i}", flags) for i in range(count)]
                fleet.wait_for_pods(urls, 1)
                results[config] = asyncio.run(replay(
                    urls, args, k, functools.partial(bar.advance, task),
                    scale_out=lambda urls=urls, fleet=fleet: fleet.scale_out(urls)))
    return report(results, args)


class Fleet:
    """One configuration's processes: a kvindex, one stand-in pod (a second at scale-out)
    and the proxies, all gone with the stack."""

    def __init__(self, stack: contextlib.ExitStack, logs: Path, args: argparse.Namespace
                 ) -> None:
        self.stack, self.logs, self.args = stack, logs, args
        port = free_port()
        self.kvindex = f"http://127.0.0.1:{port}"
        stack.enter_context(service_process(
            [AGENTSERVING, "kvindex", "--port", str(port), "--log-level", "warning"],
            self.kvindex + "/readyz", log_path=logs / "kvindex.log"))
        self.start_pod("standin-0")

    def start_pod(self, name: str) -> None:
        port = free_port()
        self.stack.enter_context(service_process(
            [sys.executable, STANDIN, "--port", str(port), "--pod-name", name,
             "--kvindex", self.kvindex, "--chunk-size", str(CHUNK), "--max-output-tokens", "4",
             "--us-per-computed-token", str(self.args.us_per_token)],
            f"http://127.0.0.1:{port}/readyz", log_path=self.logs / f"{name}.log"))

    def start_proxy(self, name: str, flags: tuple[str, ...]) -> str:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        self.stack.enter_context(service_process(
            [AGENTSERVING, "proxy", "--port", str(port), "--kvindex", self.kvindex,
             "--chunk-size", str(CHUNK), "--discovery-interval", "0.2", *flags,
             "--log-level", "warning"], url + "/readyz", log_path=self.logs / f"{name}.log"))
        return url

    def scale_out(self, urls: list[str]) -> None:
        self.start_pod("standin-1")
        self.wait_for_pods(urls, 2)

    @staticmethod
    def wait_for_pods(urls: list[str], n: int) -> None:
        deadline = time.monotonic() + 30
        for url in urls:
            while httpx.get(url + "/readyz", timeout=5).json().get("prefill_pods") != n:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{url} did not discover {n} stand-ins")
                time.sleep(0.1)


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 30000) for _ in range(n)]


async def replay(urls: list[str], args: argparse.Namespace, config_index: int, advance,
                 scale_out) -> dict:  # type: ignore[no-untyped-def]
    """Every session's turns, turn k through proxy k mod the replicas; what each turn got.
    Between the first turns (one pod) and the rest, a second pod joins."""
    turns: list[dict] = []
    first_turns_done = asyncio.Barrier(args.sessions + 1)
    scaled = asyncio.Event()

    async def session(http: httpx.AsyncClient, s: int) -> None:
        rng = random.Random(args.seed * 1_000_003 + config_index * 10_007 + s)
        await asyncio.sleep(rng.uniform(0, args.ramp_s))
        context, previous_pod = prompt(rng, args.first_tokens), None
        for k in range(args.turns):
            url = urls[k % len(urls)]
            start = time.perf_counter()
            r = await http.post(url + "/v1/completions", json={
                "model": "standin", "prompt": context, "max_tokens": 4},
                headers={"x-session-id": f"s{s}"})
            elapsed = (time.perf_counter() - start) * 1e3
            r.raise_for_status()
            body = r.json()
            pod = r.headers["x-agentserving-prefill-pod"]
            turns.append({"turn": k, "ms": elapsed, "pod": pod, "prompt": len(context),
                          "cached": body["usage"]["prompt_tokens_details"]["cached_tokens"],
                          "followed": None if previous_pod is None else pod == previous_pod})
            previous_pod = pod
            advance()
            context = context + prompt(rng, args.append_tokens)
            if k == 0:
                await first_turns_done.wait()
                await scaled.wait()
            await asyncio.sleep(args.think_s * rng.uniform(0.5, 1.5))

    async def grow() -> None:
        await first_turns_done.wait()
        await asyncio.to_thread(scale_out)
        scaled.set()

    async with httpx.AsyncClient(timeout=60) as http:
        await asyncio.gather(grow(), *(session(http, s) for s in range(args.sessions)))
    later = [t for t in turns if t["followed"] is not None]
    return {
        "proxies": len(urls),
        "turns": len(turns),
        "later_turns_on_previous_pod": sum(t["followed"] for t in later) / len(later),
        "cached_share": sum(t["cached"] for t in later) / sum(t["prompt"] for t in later),
        "latency_ms": {"p50": statistics.median(t["ms"] for t in turns),
                       "p99": percentile([t["ms"] for t in turns], 0.99)},
        "pods": {p: sum(t["pod"] == p for t in later) for p in sorted({t["pod"] for t in turns})},
    }


def report(results: dict[str, dict], args: argparse.Namespace) -> int:
    one = results["one"]
    out = {"sessions": args.sessions, "turns_per_session": args.turns,
           "first_tokens": args.first_tokens, "append_tokens": args.append_tokens,
           "configs": results, "vs_one_proxy": {}}
    print(f"{'config':<13}{'on previous pod':>17}{'cached share':>14}{'P50 ms':>9}"
          f"{'P99 ms':>9}")
    for name, r in results.items():
        out["vs_one_proxy"][name] = {
            "on_previous_pod_diff": r["later_turns_on_previous_pod"]
            - one["later_turns_on_previous_pod"],
            "cached_share_diff": r["cached_share"] - one["cached_share"],
            "latency_p50_ratio": r["latency_ms"]["p50"] / one["latency_ms"]["p50"]}
        print(f"{name:<13}{r['later_turns_on_previous_pod']:>16.1%}{r['cached_share']:>14.1%}"
              f"{r['latency_ms']['p50']:>9.2f}{r['latency_ms']['p99']:>9.2f}")
    out["target"] = {"within": 0.01, "met": {
        name: abs(out["vs_one_proxy"][name]["cached_share_diff"]) <= 0.01
        and abs(out["vs_one_proxy"][name]["on_previous_pod_diff"]) <= 0.01
        for name in ("shared", "prompt-hash")}}
    write_result(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
