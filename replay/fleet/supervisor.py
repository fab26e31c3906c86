"""The local fleet's supervisor: start in order, wait for health, watch, stop everything.

``Fleet`` starts the processes of a topology in order (kvindex; then all workers at once;
then the proxy), each time waiting until every process just started answers its health check
(``/readyz``, else ``/healthz``, else ``/health``). A process that exits while starting fails
the start with the tail of its log, and the fleet stops whatever it had started. ``stop()``
signals every process group at once (SIGTERM), waits out a grace period, SIGKILLs what is left
and reaps them all; it runs on leaving the ``with`` block, on ``atexit``, and — from
``agentserving up`` — on SIGINT/SIGTERM. Logs go to ``<run_dir>/logs/<name>.log``; the
endpoints are written to ``<run_dir>/fleet.json``.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from agentserving.replay.fleet.process import FleetError, ManagedProcess, ProcessSpec

WORKER_ROLES = ("prefill", "decode", "both")


def terminate(procs: list[ManagedProcess], grace_s: float) -> None:
    """SIGTERM every process group at once, wait out one shared ``grace_s``, SIGKILL what is
    left and reap them all."""
    import signal

    for mp in procs:
        mp.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for mp in procs:
        mp.wait_group(max(0.0, deadline - time.monotonic()))
    for mp in procs:
        mp.finish()


class Fleet:
    def __init__(self, specs: list[ProcessSpec], run_dir: Path, *,
                 log_dir: Path | None = None,
                 on_event: Callable[[str], None] | None = None,
                 stop_grace_s: float = 10.0) -> None:
        self.specs = specs
        self.stop_grace_s = stop_grace_s
        self.run_dir = Path(run_dir)
        self.log_dir = log_dir or self.run_dir / "logs"
        self.procs: list[ManagedProcess] = []
        self.on_event = on_event or (lambda _msg: None)
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self.died: list[tuple[str, int | None]] = []
        self._watcher: threading.Thread | None = None

    # ------------------------------------------------------------------ start

    def start(self) -> Fleet:
        atexit.register(self.stop)
        try:
            for wave in self._waves():
                started = []
                for spec in wave:
                    mp = ManagedProcess(spec, self.log_dir)
                    mp.start()
                    self.procs.append(mp)
                    started.append(mp)
                    self.on_event(f"started {spec.name} (pid {mp.pid}): {' '.join(spec.argv)}")
                self._wait_healthy(started)
        except BaseException:
            self.stop()
            raise
        self._write_endpoints()
        self._watcher = threading.Thread(target=self._watch, name="fleet-watch", daemon=True)
        self._watcher.start()
        return self

    def _waves(self) -> list[list[ProcessSpec]]:
        order = {"kvindex": 0, "kvserver": 0, "proxy": 2}
        waves: dict[int, list[ProcessSpec]] = {}
        for spec in self.specs:
            waves.setdefault(order.get(spec.role, 1), []).append(spec)
        return [waves[k] for k in sorted(waves)]

    def _wait_healthy(self, procs: list[ManagedProcess]) -> None:
        pending = list(procs)
        deadline = {mp.spec.name: time.monotonic() + mp.spec.startup_timeout_s for mp in procs}
        with httpx.Client() as client:
            while pending:
                for mp in list(pending):
                    if not mp.alive():
                        raise FleetError(f"{mp.spec.name} exited with {mp.returncode()} while "
                                         f"starting; log {mp.log_path}:\n{mp.log_tail()}")
                    if mp.check_health(client):
                        pending.remove(mp)
                        self.on_event(f"{mp.spec.name} ready at {mp.spec.url}")
                    elif time.monotonic() > deadline[mp.spec.name]:
                        raise FleetError(f"{mp.spec.name} not healthy after "
                                         f"{mp.spec.startup_timeout_s:.0f}s; log {mp.log_path}:"
                                         f"\n{mp.log_tail()}")
                if pending:
                    time.sleep(0.2)

    def _write_endpoints(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "fleet.json").write_text(json.dumps(self.describe(), indent=2) + "\n")

    def describe(self) -> dict[str, Any]:
        return {
            "supervisor_pid": os.getpid(),
            "proxy": self.url("proxy"),
            "kvindex": self.url("kvindex"),
            "processes": [{"name": mp.spec.name, "role": mp.spec.role, "url": mp.spec.url,
                           "pid": mp.pid, "log": str(mp.log_path), "argv": mp.spec.argv}
                          for mp in self.procs],
            "logs": str(self.log_dir),
        }

    def url(self, role: str) -> str | None:
        return next((mp.spec.url for mp in self.procs if mp.spec.role == role), None)

    def urls(self, role: str) -> list[str]:
        return [mp.spec.url for mp in self.procs if mp.spec.role == role and mp.spec.url]

    def workers(self) -> list[ManagedProcess]:
        """The worker pods that serve HTTP (prefill, decode, both), in start order."""
        return [mp for mp in self.procs if mp.spec.role in WORKER_ROLES and mp.spec.url]

    def replace(self, spec: ProcessSpec, log_dir: Path | None = None) -> ManagedProcess:
        """Stop the process of ``spec.role`` (all of that role) and start ``spec`` in its
        place, its log under ``log_dir``: a fleet that serves one configuration after another
        swaps its proxy this way. Waits until the new process is healthy."""
        with self._lock:
            old = [mp for mp in self.procs if mp.spec.role == spec.role]
            self.procs = [mp for mp in self.procs if mp.spec.role != spec.role]
        terminate(old, self.stop_grace_s)
        for mp in old:
            self.on_event(f"stopped {mp.spec.name} (pid {mp.pid})")
        mp = ManagedProcess(spec, log_dir or self.log_dir)
        mp.start()
        with self._lock:
            self.procs.append(mp)
        self.on_event(f"started {spec.name} (pid {mp.pid}): {' '.join(spec.argv)}")
        self._wait_healthy([mp])
        self._write_endpoints()
        return mp

    # ------------------------------------------------------------------ watch

    def _watch(self) -> None:
        while not self._stopped.wait(0.5):
            for mp in self.procs:
                if not mp.alive() and all(n != mp.spec.name for n, _ in self.died):
                    self.died.append((mp.spec.name, mp.returncode()))
                    self.on_event(f"{mp.spec.name} exited unexpectedly with "
                                  f"{mp.returncode()}; log {mp.log_path}")

    def check_alive(self) -> None:
        """Raise if any process has exited."""
        dead = [mp for mp in self.procs if not mp.alive()]
        if dead:
            names = ", ".join(f"{mp.spec.name} ({mp.returncode()})" for mp in dead)
            raise FleetError(f"fleet processes exited: {names}; logs in {self.log_dir}")

    # ------------------------------------------------------------------ stop

    def stop(self, grace_s: float | None = None) -> None:
        """Stop every process group (SIGTERM, then SIGKILL after ``grace_s``); idempotent."""
        grace_s = self.stop_grace_s if grace_s is None else grace_s
        with self._lock:
            if self._stopped.is_set() and not any(mp.proc and mp.group_alive()
                                                  for mp in self.procs):
                return
            self._stopped.set()
            terminate(list(reversed(self.procs)), grace_s)  # proxy first, kvindex last
            if self.procs:
                self.on_event(f"stopped {len(self.procs)} processes")
        atexit.unregister(self.stop)

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
