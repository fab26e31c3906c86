"""One supervised process: started in its own process group, stopped with all its children.

Every process runs as the leader of a new session (``setsid``), so a stop signals the whole
group — the process and anything it spawned (engine processes, LMCache workers) — first with
SIGTERM, then SIGKILL after a grace period. Each process also asks the kernel to SIGTERM it if
the supervisor dies (``PR_SET_PDEATHSIG``, through a tiny exec wrapper so the supervisor never
runs code between fork and exec), so not even a SIGKILLed supervisor leaves it orphaned.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

# Set the parent-death signal, check the parent is still the one that started us, then exec.
_WRAPPER = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)\n"
    "except Exception:\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(0)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)

DEFAULT_HEALTH_PATHS = ("/readyz", "/healthz", "/health")


class FleetError(RuntimeError):
    """A process failed to start, become healthy, or stay up."""


@dataclass
class ProcessSpec:
    name: str
    argv: list[str]
    url: str | None = None  # base URL it serves (health is checked there)
    health_paths: tuple[str, ...] = DEFAULT_HEALTH_PATHS
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 120.0
    role: str = ""  # kvindex | prefill | decode | both | proxy | ...
    memory_url: str | None = None  # a worker's memory API (its scheduler process, seed 000)


# Inherited, these would tie unrelated processes together: prometheus_client's multiprocess
# directory (set in a parent by vLLM's or LMCache's own set-up, or a user's shell) makes every
# process write its metrics there and a vLLM pod's /metrics then serve all of theirs (a pod
# showed the stale agentserving_worker_* zeros of processes from earlier tests, and the bench
# read those instead of vLLM's own figures). A spec that wants one sets it in its own env.
NOT_INHERITED = ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir")


def child_env(parent: dict[str, str] | os._Environ, own: dict[str, str]) -> dict[str, str]:
    """A fleet process's environment: its parent's, less ``NOT_INHERITED``, plus its own."""
    env = {k: v for k, v in parent.items() if k not in NOT_INHERITED}
    env.update(own)
    return env


class ManagedProcess:
    def __init__(self, spec: ProcessSpec, log_dir: Path) -> None:
        self.spec = spec
        self.log_path = log_dir / f"{spec.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._log = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        argv = [sys.executable, "-c", _WRAPPER, str(os.getpid()), *self.spec.argv]
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     env=child_env(os.environ, self.spec.env))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def returncode(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def check_health(self, client: httpx.Client) -> bool:
        """True once one of the health paths answers 2xx (404: try the next path)."""
        if self.spec.url is None:
            return self.alive()
        for path in self.spec.health_paths:
            try:
                r = client.get(self.spec.url + path, timeout=2.0)
            except httpx.HTTPError:
                return False
            if r.is_success:
                return True
            if r.status_code != 404:
                return False
        return False

    def signal_group(self, sig: int) -> bool:
        """Signal the whole process group; False when nothing is left in it."""
        if self.proc is None:
            return False
        try:
            os.killpg(self.proc.pid, sig)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:  # pragma: no cover - a recycled pgid that is not ours
            return False

    def group_alive(self) -> bool:
        return self.signal_group(0)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the group, wait, SIGKILL what is left, reap."""
        if self.proc is None:
            return
        self.signal_group(signal.SIGTERM)
        self.wait_group(grace_s)
        self.finish()

    def wait_group(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None:
                self.proc.poll()  # reap the leader so the group can empty
            if not self.group_alive():
                return
            time.sleep(0.05)

    def finish(self) -> None:
        """SIGKILL whatever is left of the group and reap the leader."""
        if self.proc is None:
            return
        if self.group_alive():
            self.signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        if self._log is not None:
            self._log.close()
            self._log = None
