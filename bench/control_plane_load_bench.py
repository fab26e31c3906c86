"""Control plane under load: 1,000 concurrent agent sessions through the real proxy, the real
kvindex and a real Redis ("Reliability under load").

    python -m bench control_plane_load [--quick] [--sessions N] [--out PATH]

Every component is a real process on loopback: ``redis-server`` (free port, no persistence, a
temp dir), ``agentserving kvindex --store redis://...``, ``agentserving proxy --routing
kv-aware`` discovering its pods from the kvindex, and 2-4 stand-in workers
(``bench/standin_worker.py``: OpenAI-compatible, answer at once, hash prompts with
``agentserving.core.hashing``, register with the kvindex and publish a residency event per chunk
they "computed"). The stand-ins do no model work, so what is measured is the control plane
alone: 1,000 real sessions cannot decode on 2 cores.

Each session is a multi-turn agent: a first turn of a few thousand token ids, then turns that
append the answer and a few hundred tokens of tool result, a short think time between turns,
every turn with its ``x-session-id``. From the second turn on the proxy looks the session's
previous chunk hashes up in the kvindex (which the stand-ins filled) and routes to the pod
holding them. Sessions start spread over ``--ramp-s``. The think time sets the offered load:
1,000 sessions thinking 5 s make ~140 turns/s, about half of a 2-core machine once every process
is counted (3 s saturates it, and then the tails measure the CPU queue; ``cpu_cores_busy`` and
``machine_cores_busy`` in the JSON say which it was). Each turn is also sent, byte for byte,
straight to the stand-in the proxy chose (interleaved: proxy first, then direct, or the other
way round on alternate turns), so the proxy's added latency is the through-proxy latency minus
the direct one (P50 and P99 of each distribution; the paired per-turn differences are reported
too). While the load runs, the bench times its own kvindex lookups of live sessions' chains
(``POST /v1/lookup``, as the proxy asks); after it, it reads the kvindex's and the proxy's
``/metrics`` histograms (the Redis lookup op, the proxy's routing time), every process's peak
RSS (``VmHWM``), and the index's size (``GET /v1/pods`` and Redis ``DBSIZE`` / ``HLEN``).

Errors, by kind: a proxied turn that failed (HTTP status, exception class) or came back
malformed, a turn the proxy routed without the kvindex (``x-agentserving-degraded``), a failed
direct call, a failed sampled lookup. Latencies count every answered turn, the degraded ones
too. Targets: 0 errors, proxy + index added P99 < 10 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import random
import resource
import statistics
import sys
import tempfile
import time
from array import array
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from agentserving.core.hashing import DEFAULT_CHUNK_SIZE
from bench.common import add_out_args, percentile, write_result
from bench.common import progress as common_progress
from testkit.servers import AGENTSERVING, RedisServer, free_port, service_process

NAME = "control_plane_load"
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / f"{NAME}.json"
ROOT = Path(__file__).resolve().parents[1]
MODEL = "standin"
TARGET_ERRORS = 0
TARGET_ADDED_P99_MS = 10.0
WARMUP_SESSIONS, WARMUP_TURNS = 8, 3  # unmeasured, before the load
H_SESSION = "x-session-id"  # services/proxy/app.py
H_PREFILL = "x-agentserving-prefill-pod"  # services/proxy/orchestrator.py
H_ROUTING = "x-agentserving-routing"
H_DEGRADED = "x-agentserving-degraded"

FULL = {"sessions": 1000, "turns": 6, "first_tokens": 3000, "append_tokens": 300,
        "think_s": 5.0, "ramp_s": 10.0}
QUICK = {"sessions": 50, "turns": 3, "first_tokens": 2000, "append_tokens": 200,
         "think_s": 0.2, "ramp_s": 1.0}
# each size flag's type and meaning; its help says both defaults, read from FULL and QUICK
SIZES = {"sessions": (int, "concurrent agent sessions"),
         "turns": (int, "turns per session, the first included"),
         "first_tokens": (int, "mean first-turn prompt, in token ids; each session draws from "
                               "0.75x-1.25x"),
         "append_tokens": (int, "mean tokens a later turn appends (tool result), drawn from "
                                "0.5x-1.5x"),
         "think_s": (float, "mean think time between a session's turns, drawn from 0.5x-1.5x"),
         "ramp_s": (float, "sessions start spread evenly over this many seconds")}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench control_plane_load", description=__doc__.split("\n\n")[0],
        epilog="Defaults: 1,000 sessions x 6 turns, 3,000-token first turns, 300-token appends, "
               "5 s think, 10 s ramp; --quick: 50 x 3, 2,000 / 200 tokens, 0.2 s think, 1 s "
               "ramp. A flag given explicitly wins over either.")
    add_out_args(parser, DEFAULT_OUT, "50 sessions x 3 turns, well under a minute")
    for key, (kind, what) in SIZES.items():
        parser.add_argument("--" + key.replace("_", "-"), type=kind, default=None,
                            help=f"{what} (default {FULL[key]:g}; {QUICK[key]:g} with --quick)")
    parser.add_argument("--output-tokens", type=int, default=8,
                        help="max_tokens of every turn; the answer is appended to the context "
                             "(default 8)")
    parser.add_argument("--workers", type=int, default=3, choices=(2, 3, 4),
                        help="stand-in worker processes (default 3)")
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE,
                        help=f"tokens per KV chunk, proxy and stand-ins alike "
                             f"(default {DEFAULT_CHUNK_SIZE})")
    parser.add_argument("--lookup-rate", type=float, default=20.0,
                        help="the bench's own timed kvindex lookups per second during the load "
                             "(default 20; 0: none)")
    parser.add_argument("--lookups", choices=("replica", "kvindex"), default="replica",
                        help="where the proxy looks each turn up: its in-process residency "
                             "replica (default) or the kvindex, a round trip per turn "
                             "(--no-residency-replica, the proxy without its replica)")
    parser.add_argument("--seed", type=int, default=19, help="random seed (default 19)")
    parser.add_argument("--logs", type=Path, default=None,
                        help="keep every process's log in this folder (default: a temp folder, "
                             "deleted at the end)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    for key, value in sizes.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.sessions < 1 or args.turns < 1 or args.first_tokens < args.chunk_size:
        parser.error("need --sessions >= 1, --turns >= 1 and --first-tokens >= --chunk-size")
    return args


# ------------------------------------------------------------------------------- processes


@dataclass
class Fleet:
    redis: RedisServer
    kvindex_url: str
    proxy_url: str
    workers: dict[str, str]  # pod name -> base URL
    pids: dict[str, int]  # process label -> pid
    logs: Path


def _raise_fd_limit(sessions: int) -> None:
    """Each session can hold a socket to the proxy and one to a worker; so can the proxy."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, 4 * sessions + 1024))
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))  # children inherit it


@contextlib.contextmanager
def fleet(args: argparse.Namespace, stack: contextlib.ExitStack, logs: Path) -> Iterator[Fleet]:
    redis = RedisServer()
    stack.callback(redis.stop)
    kv_port = free_port()
    kvindex = f"http://127.0.0.1:{kv_port}"
    kv = stack.enter_context(service_process(
        [AGENTSERVING, "kvindex", "--port", str(kv_port), "--store", redis.url,
         "--log-level", "warning"], kvindex + "/readyz", log_path=logs / "kvindex.log"))
    pids = {"redis": redis.proc.pid, "kvindex": kv.pid}
    workers = {}
    # run as a script: the repository root on PYTHONPATH would shadow the stdlib's
    # ``operator`` with the repository's operator/ folder
    standin = str(ROOT / "bench" / "standin_worker.py")
    for i in range(args.workers):
        name, port = f"standin-{i}", free_port()
        url = f"http://127.0.0.1:{port}"
        proc = stack.enter_context(service_process(
            [sys.executable, standin, "--port", str(port), "--pod-name",
             name, "--kvindex", kvindex, "--chunk-size", str(args.chunk_size),
             "--max-output-tokens", str(args.output_tokens)],
            url + "/readyz", log_path=logs / f"{name}.log"))
        workers[name], pids[name] = url, proc.pid
    proxy_port = free_port()
    proxy = f"http://127.0.0.1:{proxy_port}"
    pp = stack.enter_context(service_process(
        [AGENTSERVING, "proxy", "--port", str(proxy_port), "--kvindex", kvindex,
         "--routing", "kv-aware", "--chunk-size", str(args.chunk_size),
         "--discovery-interval", "1", "--log-level", "warning",
         *(["--no-residency-replica"] if args.lookups == "kvindex" else [])],
        proxy + "/readyz", log_path=logs / "proxy.log"))
    pids["proxy"] = pp.pid
    deadline = time.monotonic() + 30
    while httpx.get(proxy + "/readyz", timeout=5).json().get("prefill_pods") != args.workers:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the proxy did not discover all {args.workers} stand-ins")
        time.sleep(0.2)
    yield Fleet(redis, kvindex, proxy, workers, pids, logs)


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of a process so far (this one when ``pid`` is None)."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(fields) - idle) / tick, sum(fields) / tick


def cpu_now(pids: dict[str, int]) -> dict[str, float]:
    out = {"bench_client": cpu_seconds()}
    for label, pid in pids.items():
        with contextlib.suppress(OSError):
            out[label] = cpu_seconds(pid)
    return out


def peak_rss_mib(pid: int) -> float | None:
    """The process's peak resident set (VmHWM, kept by the kernel), in MiB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


# ------------------------------------------------------------------------------- workload


def tokens(rng: random.Random, n: int) -> list[int]:
    """``n`` small token ids (0-4095): short JSON, distinct prefixes per session."""
    return [t & 0xFFF for t in array("H", rng.randbytes(2 * n))]


@dataclass
class Results:
    proxy_ms: list[float] = field(default_factory=list)
    direct_ms: list[float] = field(default_factory=list)
    proxy_at: list[float] = field(default_factory=list)  # when each proxy sample ended
    direct_at: list[float] = field(default_factory=list)
    paired_added_ms: list[float] = field(default_factory=list)
    lookup_ms: list[float] = field(default_factory=list)
    lookup_hits: int = 0
    errors: Counter = field(default_factory=Counter)
    error_examples: dict[str, str] = field(default_factory=dict)  # kind -> its first one
    turns_sent: int = 0
    turns_ok: int = 0
    direct_sent: int = 0
    later_turns: int = 0
    kv_hits: int = 0  # later turns whose pod held the previous turn's chunks
    same_pod: int = 0  # later turns routed where the previous one ran
    pods_used: Counter = field(default_factory=Counter)
    chunks_served: set[str] = field(default_factory=set)
    alive: int = 0
    peak_alive: int = 0
    inflight: int = 0
    peak_inflight: int = 0
    chains: dict[int, list[str]] = field(default_factory=dict)  # session -> latest hashes
    started: float = 0.0
    finished: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=dict)  # per process, over the load
    machine_busy_s: float = 0.0  # every process on the machine, ours and others'


@contextlib.contextmanager
def progress(enabled: bool, sessions: int, turns: int) -> Iterator[Any]:
    """The bars (sessions started, turns done): bench.common's, or its silent stand-in."""
    with common_progress(enabled) as bar:
        yield (bar, bar.add_task("sessions started", total=sessions),
               bar.add_task("turns done      ", total=sessions * turns))


class Load:
    def __init__(self, args: argparse.Namespace, fl: Fleet, http: Any, bar: Any,
                 bar_sessions: Any, bar_turns: Any) -> None:
        import msgspec

        self.args, self.fleet, self.http = args, fl, http
        self.bar, self.bar_sessions, self.bar_turns = bar, bar_sessions, bar_turns
        self.r = Results()
        self.encode = msgspec.json.encode
        self.decode = msgspec.json.decode
        self.pod_names = sorted(fl.workers)
        self.done = False

    def error(self, kind: str, example: str) -> None:
        self.r.errors[kind] += 1
        self.r.error_examples.setdefault(kind, example[:300])

    async def call(self, url: str, data: bytes, headers: dict[str, str], n_tokens: int,
                   path: str) -> tuple[float, dict[str, Any] | None, Any, str | None]:
        """(ms, payload, response headers, error kind or None) of one completion call."""
        import aiohttp

        r = self.r
        r.inflight += 1
        r.peak_inflight = max(r.peak_inflight, r.inflight)
        start = time.perf_counter()
        try:
            async with self.http.post(url + "/v1/completions", data=data,
                                      headers=headers) as resp:
                content = await resp.read()
                ms = (time.perf_counter() - start) * 1e3
                if resp.status != 200:
                    self.r.error_examples.setdefault(f"{path}:http_{resp.status}",
                                                     content[:300].decode(errors="replace"))
                    return ms, None, resp.headers, f"{path}:http_{resp.status}"
                try:
                    payload = self.decode(content)
                except Exception:  # noqa: BLE001 - any undecodable body is one error kind
                    self.r.error_examples.setdefault(f"{path}:bad_json",
                                                     content[:300].decode(errors="replace"))
                    return ms, None, resp.headers, f"{path}:bad_json"
                err = self.check(payload, n_tokens, path)
                if err is not None:
                    self.r.error_examples.setdefault(err, content[:300].decode(errors="replace"))
                return ms, payload, resp.headers, err
        except (TimeoutError, aiohttp.ClientError) as exc:
            kind = f"{path}:{type(exc).__name__}"
            self.r.error_examples.setdefault(kind, repr(exc)[:300])
            return (time.perf_counter() - start) * 1e3, None, {}, kind
        finally:
            r.inflight -= 1

    def check(self, payload: Any, n_tokens: int, path: str) -> str | None:
        try:
            usage = payload["usage"]
            hashes = payload["kv_transfer_params"]["chunk_hashes"]
            ok = (usage["prompt_tokens"] == n_tokens and isinstance(
                usage["prompt_tokens_details"]["cached_tokens"], int)
                and usage["completion_tokens"] >= 1 and payload["choices"]
                and len(hashes) == n_tokens // self.args.chunk_size)
        except (KeyError, TypeError, IndexError):
            ok = False
        return None if ok else f"{path}:bad_body"

    async def session(self, i: int, warmup: bool = False) -> None:
        a, r = self.args, self.r
        rng = random.Random(a.seed * 1_000_003 + i + (10**9 if warmup else 0))
        if not warmup:
            await asyncio.sleep(a.ramp_s * i / a.sessions)
            self.bar.advance(self.bar_sessions)
        r.alive += 1
        r.peak_alive = max(r.peak_alive, r.alive)
        sid = f"warmup-{i:05d}" if warmup else f"bench-{i:05d}"
        headers = {H_SESSION: sid, "content-type": "application/json"}
        prompt = tokens(rng, int(a.first_tokens * rng.uniform(0.75, 1.25)))
        last_pod: str | None = None
        held_chunks = 0  # full chunks of the previous turn's prompt
        turns = WARMUP_TURNS if warmup else a.turns
        try:
            for t in range(turns):
                if t:
                    prompt += [7] * a.output_tokens  # the answer, as the next turn sends it
                    prompt += tokens(rng, max(1, int(a.append_tokens * rng.uniform(0.5, 1.5))))
                data = self.encode({"model": MODEL, "prompt": prompt,
                                    "max_tokens": a.output_tokens, "temperature": 0})
                direct_first = t > 0 and last_pod is not None and (i + t) % 2 == 1
                direct_ms = None
                if direct_first:
                    direct_ms = await self.direct(last_pod, data, headers, len(prompt))
                r.turns_sent += 1
                ms, payload, resp_headers, err = await self.call(
                    self.fleet.proxy_url, data, headers, len(prompt), "proxy")
                pod = resp_headers.get(H_PREFILL) if resp_headers else None
                if err is None and pod not in self.fleet.workers:
                    err = "proxy:unknown_pod_header"
                if err is not None:  # no answer to time or learn from
                    r.errors[err] += 1
                else:  # answered: timed even when routed wrongly (an error all the same)
                    wrong = None
                    if resp_headers.get(H_ROUTING) != "kv-aware":
                        wrong = "proxy:not_kv_aware"
                    elif resp_headers.get(H_DEGRADED):
                        wrong = "proxy:degraded_kvindex_unavailable"
                        r.error_examples.setdefault(wrong, resp_headers[H_DEGRADED])
                    if wrong is not None:
                        r.errors[wrong] += 1
                    else:
                        r.turns_ok += 1
                    r.proxy_ms.append(ms)
                    r.proxy_at.append(time.perf_counter())
                    r.pods_used[pod] += 1
                    hashes = payload["kv_transfer_params"]["chunk_hashes"]
                    r.chunks_served.update(hashes)
                    r.chains[i] = hashes
                    if t:
                        r.later_turns += 1
                        cached = payload["usage"]["prompt_tokens_details"]["cached_tokens"]
                        r.kv_hits += cached >= held_chunks * a.chunk_size
                        r.same_pod += pod == last_pod
                    held_chunks = len(hashes)
                    last_pod = pod
                target = pod if err is None else (last_pod or self.pod_names[i % len(
                    self.pod_names)])
                if not direct_first:
                    direct_ms = await self.direct(target, data, headers, len(prompt))
                if err is None and direct_ms is not None:
                    r.paired_added_ms.append(ms - direct_ms)
                if warmup:
                    continue
                self.bar.advance(self.bar_turns)
                if t + 1 < a.turns:
                    await asyncio.sleep(a.think_s * rng.uniform(0.5, 1.5))
        finally:
            r.alive -= 1

    async def direct(self, pod: str, data: bytes, headers: dict[str, str], n: int
                     ) -> float | None:
        self.r.direct_sent += 1
        ms, _payload, _h, err = await self.call(self.fleet.workers[pod], data, headers, n,
                                                "direct")
        if err is not None:
            self.r.errors[err] += 1
            return None
        self.r.direct_ms.append(ms)
        self.r.direct_at.append(time.perf_counter())
        return ms

    async def sample_lookups(self) -> None:
        """Time kvindex lookups of live sessions' latest chains, as the proxy asks them."""
        import aiohttp

        if self.args.lookup_rate <= 0:
            return
        rng = random.Random(self.args.seed)
        url = self.fleet.kvindex_url + "/v1/lookup"
        while not self.done:
            await asyncio.sleep(1.0 / self.args.lookup_rate)
            if not self.r.chains:
                continue
            chain = self.r.chains[rng.choice(list(self.r.chains))]
            body = self.encode({"chunk_hashes": chain, "pods": self.pod_names,
                                "role": "prefill"})
            start = time.perf_counter()
            try:
                async with self.http.post(url, data=body, headers={
                        "content-type": "application/json"}) as resp:
                    content = await resp.read()
                    ms = (time.perf_counter() - start) * 1e3
                    if resp.status != 200:
                        self.error(f"kvindex_lookup:http_{resp.status}",
                                   content.decode(errors="replace"))
                        continue
            except (TimeoutError, aiohttp.ClientError) as exc:
                self.error(f"kvindex_lookup:{type(exc).__name__}", repr(exc))
                continue
            self.r.lookup_ms.append(ms)
            self.r.lookup_hits += bool(self.decode(content).get("pods"))

    async def warm_up(self) -> None:
        """A few unmeasured sessions first, so that no process's first-call costs (imports,
        connection pools, caches) count as load; their errors still count."""
        measured = self.r
        self.r = Results()
        try:
            await asyncio.gather(*(self.session(i, warmup=True) for i in range(WARMUP_SESSIONS)))
        finally:
            warm, self.r = self.r, measured
        measured.chunks_served |= warm.chunks_served
        for kind, n in warm.errors.items():
            measured.errors[f"warmup:{kind}"] += n
            measured.error_examples.setdefault(f"warmup:{kind}",
                                               warm.error_examples.get(kind, ""))

    async def run(self) -> Results:
        await self.warm_up()
        sampler = asyncio.create_task(self.sample_lookups())
        cpu_before, machine_before = cpu_now(self.fleet.pids), machine_cpu()
        self.r.started = time.perf_counter()
        try:
            await asyncio.gather(*(self.session(i) for i in range(self.args.sessions)))
        finally:
            self.r.finished = time.perf_counter()
            self.done = True
            await sampler
        cpu_after, machine_after = cpu_now(self.fleet.pids), machine_cpu()
        self.r.machine_busy_s = machine_after[0] - machine_before[0]
        self.r.cpu_s = {k: round(cpu_after[k] - v, 2) for k, v in cpu_before.items()
                        if k in cpu_after}
        return self.r


async def drive(args: argparse.Namespace, fl: Fleet) -> Results:
    import aiohttp

    # keep-alive shorter than uvicorn's 5 s, so the client never reuses a socket the proxy
    # is closing (a think time longer than that reconnects, as a real client would)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=3.0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=120)) as http:
        with progress(not args.no_progress, args.sessions, args.turns) as (bar, s_task, t_task):
            return await Load(args, fl, http, bar, s_task, t_task).run()


# ------------------------------------------------------------------------------- after


def histogram(metrics_text: str, name: str, labels: dict[str, str] | None = None
              ) -> dict[str, Any] | None:
    """P50/P99 (ms) of a Prometheus histogram, interpolated within buckets as
    ``histogram_quantile`` does, with its count; None when it has no samples."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets: list[tuple[float, float]] = []
    count = 0.0
    for family in text_string_to_metric_families(metrics_text):
        if family.name != name:
            continue
        for s in family.samples:
            if labels and any(s.labels.get(k) != v for k, v in labels.items()):
                continue
            if s.name == name + "_bucket":
                buckets.append((float(s.labels["le"]), s.value))
            elif s.name == name + "_count":
                count = s.value
    if not count:
        return None
    buckets.sort()

    def quantile(q: float) -> float:
        rank = q * count
        lower, below = 0.0, 0.0
        for le, cumulative in buckets:
            if cumulative >= rank:
                if le == float("inf"):
                    return lower
                share = (rank - below) / (cumulative - below) if cumulative > below else 1.0
                return lower + (le - lower) * share
            lower, below = le, cumulative
        return lower

    return {"p50_ms": round(quantile(0.5) * 1e3, 3), "p99_ms": round(quantile(0.99) * 1e3, 3),
            "count": int(count)}


def counter_total(metrics_text: str, name: str) -> dict[str, float]:
    """A counter's samples by their label values ("" for an unlabelled one)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name == name.removesuffix("_total"):
            for s in family.samples:
                if s.name.endswith("_total"):
                    out[",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))] = s.value
    return out


def index_sizes(fl: Fleet) -> dict[str, Any]:
    """The kvindex's tables once the stand-ins' last events are in (waits up to 15 s)."""
    import redis

    deadline = time.monotonic() + 15
    with httpx.Client(timeout=10) as http:
        while True:
            stats = [http.get(url + "/standin/stats").json() for url in fl.workers.values()]
            pods = http.get(fl.kvindex_url + "/v1/pods").json()["pods"]
            held = sum(s["chunks"] for s in stats)
            indexed = sum(sum(p["chunks"].values()) for p in pods)
            converged = held == indexed and not any(s["pending_events"] for s in stats)
            if converged or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    tiers: Counter = Counter()
    for p in pods:
        tiers.update(p["chunks"])
    client = redis.Redis.from_url(fl.redis.url)
    try:
        memory = client.info("memory")
        out = {"pods": len(pods), "chunks_by_tier": dict(tiers), "pod_chunks": indexed,
               "standin_chunks_held": held, "converged": converged,
               "redis_dbsize": client.dbsize(),
               "redis_chunk_table_entries": client.hlen("as:chunks"),
               "redis_used_memory_mib": round(memory["used_memory"] / 2**20, 1),
               "standin_requests": {s["pod"]: s["requests"] for s in stats}}
    finally:
        client.close()
    return out


def lat(samples: list[float]) -> dict[str, Any]:
    if not samples:
        return {"p50_ms": None, "p90_ms": None, "p99_ms": None, "max_ms": None,
                "mean_ms": None, "samples": 0}
    return {"p50_ms": round(percentile(samples, 0.5), 3),
            "p90_ms": round(percentile(samples, 0.9), 3),
            "p99_ms": round(percentile(samples, 0.99), 3), "max_ms": round(max(samples), 3),
            "mean_ms": round(statistics.fmean(samples), 3), "samples": len(samples)}


def windows(r: Results, width_s: float) -> list[dict[str, Any]]:
    """Turns and latencies per ``width_s`` of the load: where in the run the tail is."""
    out = []
    n = max(1, int((r.finished - r.started) / width_s + 0.999))
    for w in range(n):
        lo, hi = r.started + w * width_s, r.started + (w + 1) * width_s
        proxy = [ms for ms, at in zip(r.proxy_ms, r.proxy_at, strict=True) if lo <= at < hi]
        direct = [ms for ms, at in zip(r.direct_ms, r.direct_at, strict=True) if lo <= at < hi]
        out.append({"from_s": round(w * width_s, 1), "turns": len(proxy),
                    "proxy_p50_ms": lat(proxy)["p50_ms"], "proxy_p99_ms": lat(proxy)["p99_ms"],
                    "direct_p50_ms": lat(direct)["p50_ms"],
                    "direct_p99_ms": lat(direct)["p99_ms"]})
    return out


def summarize(args: argparse.Namespace, r: Results, after: dict[str, Any]) -> dict[str, Any]:
    proxy, direct = lat(r.proxy_ms), lat(r.direct_ms)

    def diff(key: str) -> float | None:
        if proxy[key] is None or direct[key] is None:
            return None
        return round(proxy[key] - direct[key], 3)

    added = {"p50_ms": diff("p50_ms"), "p99_ms": diff("p99_ms"),
             "paired_p50_ms": round(statistics.median(r.paired_added_ms), 3)
             if r.paired_added_ms else None,
             "paired_p99_ms": round(percentile(r.paired_added_ms, 0.99), 3)
             if r.paired_added_ms else None,
             "pairs": len(r.paired_added_ms)}
    errors = sum(r.errors.values())
    duration = r.finished - r.started
    added_p99 = added["p99_ms"]
    return {
        "bench": NAME,
        "quick": args.quick,
        "config": {"sessions": args.sessions, "turns_per_session": args.turns,
                   "first_tokens_mean": args.first_tokens,
                   "append_tokens_mean": args.append_tokens,
                   "output_tokens": args.output_tokens, "think_s_mean": args.think_s,
                   "ramp_s": args.ramp_s, "standin_workers": args.workers,
                   "chunk_size": args.chunk_size, "routing": "kv-aware",
                   "lookups": args.lookups,
                   "kvindex_store": "redis", "lookup_rate_per_s": args.lookup_rate,
                   "seed": args.seed, "python": platform.python_version(),
                   "cpus": os.cpu_count(), "load_average_1m_at_start": args.load_at_start,
                   "load_average_1m_at_end": round(os.getloadavg()[0], 2)},
        "sessions": args.sessions,
        "peak_concurrent_sessions": r.peak_alive,
        "peak_inflight_requests": r.peak_inflight,
        "turns": r.turns_sent,
        "turns_ok": r.turns_ok,
        "direct_calls": r.direct_sent,
        "duration_s": round(duration, 2),
        "turns_per_s": round(r.turns_sent / duration, 1) if duration else None,
        "errors": {"total": errors, "by_kind": dict(sorted(r.errors.items())),
                   "examples": dict(sorted(r.error_examples.items()))},
        "latency_ms": {"through_proxy": proxy, "direct": direct},
        "added_ms": added,
        "by_window": windows(r, 5.0 if duration > 20 else 1.0),
        "kvindex_lookup_ms": {
            "http_from_bench": {**lat(r.lookup_ms), "hits": r.lookup_hits},
            "redis_backend_histogram": after["kvindex_backend_lookup"]},
        "proxy_routing_ms_histogram": after["proxy_routing"],
        "routing": {"later_turns": r.later_turns, "kv_hits": r.kv_hits,
                    "kv_hit_share": round(r.kv_hits / r.later_turns, 4)
                    if r.later_turns else None,
                    "same_pod_as_previous_turn": r.same_pod,
                    "turns_by_pod": dict(sorted(r.pods_used.items())),
                    "proxy_counters": after["proxy_counters"],
                    "kvindex_counters": after["kvindex_counters"]},
        "peak_rss_mib": after["peak_rss_mib"],
        # CPU seconds each process spent during the measured load, and its share of one core
        "cpu_s": r.cpu_s,
        "cpu_cores_busy": {k: round(v / duration, 3) for k, v in r.cpu_s.items()}
        if duration else {},
        "machine_cores_busy": round(r.machine_busy_s / duration, 2) if duration else None,
        "machine_cores": os.cpu_count(),
        "index": {**after["index"], "distinct_chunks_served": len(r.chunks_served)},
        "targets": {
            "errors": {"target": TARGET_ERRORS, "value": errors,
                       "met": errors <= TARGET_ERRORS},
            "added_p99_ms": {"target_lt": TARGET_ADDED_P99_MS, "value": added_p99,
                             "met": added_p99 is not None and added_p99 < TARGET_ADDED_P99_MS},
        },
    }


def print_report(rep: dict[str, Any]) -> None:
    lp, ld, ad = rep["latency_ms"]["through_proxy"], rep["latency_ms"]["direct"], rep["added_ms"]
    kl = rep["kvindex_lookup_ms"]
    kb = kl["redis_backend_histogram"] or {}
    pr = rep["proxy_routing_ms_histogram"] or {}
    rss = rep["peak_rss_mib"]
    idx = rep["index"]
    t = rep["targets"]

    def f(v: Any) -> str:
        return "-" if v is None else (f"{v:,.2f}" if isinstance(v, float) else f"{v:,}")

    lines = [
        f"control plane load{' (quick)' if rep['quick'] else ''}: {rep['sessions']:,} sessions "
        f"(peak {rep['peak_concurrent_sessions']:,} concurrent), {rep['turns']:,} turns in "
        f"{rep['duration_s']} s = {f(rep['turns_per_s'])} turns/s, "
        f"{rep['config']['standin_workers']} stand-in workers",
        f"  errors: {rep['errors']['total']} {rep['errors']['by_kind'] or ''}",
        f"  E2E through proxy  P50 {f(lp['p50_ms'])} ms  P99 {f(lp['p99_ms'])} ms",
        f"  E2E direct         P50 {f(ld['p50_ms'])} ms  P99 {f(ld['p99_ms'])} ms",
        f"  proxy added        P50 {f(ad['p50_ms'])} ms  P99 {f(ad['p99_ms'])} ms "
        f"(paired per turn: P50 {f(ad['paired_p50_ms'])}  P99 {f(ad['paired_p99_ms'])})",
        f"  kvindex lookup     P50 {f(kl['http_from_bench']['p50_ms'])} ms  P99 "
        f"{f(kl['http_from_bench']['p99_ms'])} ms over HTTP ({kl['http_from_bench']['samples']}"
        f" timed); Redis op P50 {f(kb.get('p50_ms'))}  P99 {f(kb.get('p99_ms'))} ms "
        f"({f(kb.get('count'))} lookups, /metrics)",
        f"  proxy routing      P50 {f(pr.get('p50_ms'))} ms  P99 {f(pr.get('p99_ms'))} ms "
        f"(/metrics, kvindex lookup included)",
        f"  kv-aware: {rep['routing']['kv_hits']}/{rep['routing']['later_turns']} later turns "
        f"on a pod holding the previous context",
        "  peak RSS MiB: " + ", ".join(f"{k} {f(v)}" for k, v in rss.items()),
        "  CPU cores busy during the load: " + ", ".join(
            f"{k} {v:.2f}" for k, v in rep["cpu_cores_busy"].items())
        + f"; the whole machine {rep['machine_cores_busy']} of {rep['machine_cores']}",
        f"  index: {idx['pods']} pods, {idx['pod_chunks']:,} chunk residencies "
        f"({idx['redis_chunk_table_entries']:,} chunks in Redis, DBSIZE {idx['redis_dbsize']}, "
        f"{idx['redis_used_memory_mib']} MiB), {idx['distinct_chunks_served']:,} distinct "
        f"chunks served",
        f"  target errors == 0: {'met' if t['errors']['met'] else 'NOT met'}; "
        f"target added P99 < {TARGET_ADDED_P99_MS:g} ms: "
        f"{'met' if t['added_p99_ms']['met'] else 'NOT met'} ({f(t['added_p99_ms']['value'])})",
    ]
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.load_at_start = round(os.getloadavg()[0], 2)
    _raise_fd_limit(args.sessions)
    with contextlib.ExitStack() as stack:
        if args.logs is not None:
            args.logs.mkdir(parents=True, exist_ok=True)
            logs = args.logs
        else:
            logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="cpload-")))
        fl = stack.enter_context(fleet(args, stack, logs))
        try:
            import uvloop

            results = uvloop.run(drive(args, fl))
        except ImportError:
            results = asyncio.run(drive(args, fl))
        with httpx.Client(timeout=10) as http:
            kv_metrics = http.get(fl.kvindex_url + "/metrics").text
            proxy_metrics = http.get(fl.proxy_url + "/metrics").text
        after = {
            "kvindex_backend_lookup": histogram(kv_metrics, "kvindex_backend_op_seconds",
                                                {"store": "redis", "op": "lookup"}),
            "proxy_routing": histogram(proxy_metrics, "proxy_routing_seconds"),
            "proxy_counters": {
                "failed_turns": counter_total(proxy_metrics, "proxy_failed_turns_total"),
                "retries": counter_total(proxy_metrics, "proxy_retries_total"),
                "degraded": counter_total(proxy_metrics, "proxy_degraded_total")},
            "kvindex_counters": {
                "lookups": counter_total(kv_metrics, "kvindex_lookups_total"),
                "chunk_events": counter_total(kv_metrics, "kvindex_chunk_events_total"),
                "event_batches": counter_total(kv_metrics, "kvindex_event_batches_total"),
                "backend_unavailable": counter_total(kv_metrics,
                                                     "kvindex_backend_unavailable_total")},
            "index": index_sizes(fl),
            "peak_rss_mib": {label: peak_rss_mib(pid) for label, pid in fl.pids.items()},
        }
    report = summarize(args, results, after)
    print_report(report)
    write_result(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
