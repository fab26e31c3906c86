"""A local fleet of real processes on loopback: kvindex, workers (tiny model), proxies, all
sharing one internal token (core.internal_auth), as a deployment's components do."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from agentserving.core.internal_auth import TOKEN_ENV, auth_headers
from testkit.servers import AGENTSERVING, free_port, free_port_run, service_process


@dataclass
class Proc:
    url: str
    proc: object
    log: Path
    memory_url: str | None = None  # a worker's memory API
    engine_memory_url: str | None = None  # its engine process's (seed 000: port + 1)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # type: ignore[attr-defined]
        self.proc.wait()  # type: ignore[attr-defined]


@dataclass
class Fleet:
    root: Path
    stack: contextlib.ExitStack
    kvindex: Proc | None = None
    workers: dict[str, Proc] = field(default_factory=dict)
    token: str = field(default_factory=lambda: secrets.token_urlsafe(16))

    @property
    def env(self) -> dict[str, str]:
        return {TOKEN_ENV: self.token}

    @property
    def headers(self) -> dict[str, str]:
        """What a caller of the kvindex or a memory API must send."""
        return auth_headers(self.token)

    def start_kvindex(self, *extra: str, name: str = "kvindex") -> Proc:
        """A kvindex; the first one started is the one workers and proxies use by default."""
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = self.root / f"{name}.log"
        proc = self.stack.enter_context(service_process(
            [AGENTSERVING, "kvindex", "--port", str(port), "--lease-ttl", "3",
             "--reap-interval", "0.5", *extra], url + "/readyz", env=self.env, log_path=log))
        started = Proc(url, proc, log)
        self.kvindex = self.kvindex or started
        return started

    def start_worker(self, name: str, role: str = "both", disk: bool = True,
                     cpu_gib: float = 0.25, extra: tuple[str, ...] = ()) -> Proc:
        port, mem = free_port(), free_port_run(2)
        url = f"http://127.0.0.1:{port}"
        args = [AGENTSERVING, "worker", "--role", role, "--port", str(port),
                "--memory-port-start", str(mem), "--pod-name", name, "--model", "tiny",
                "--cpu-cache-gib", str(cpu_gib), "--chunk-size", "256", "--torch-threads", "1",
                "--heartbeat-interval", "0.5", *extra]
        if self.kvindex is not None:
            args += ["--kvindex", self.kvindex.url]
        if disk:
            args += ["--disk-cache-dir", str(self.root / f"disk-{name}"), "--disk-cache-gib", "1"]
        log = self.root / f"worker-{name}.log"
        proc = self.stack.enter_context(service_process(args, url + "/readyz", env=self.env,
                                                        log_path=log, timeout_s=180))
        self.workers[name] = Proc(url, proc, log, memory_url=f"http://127.0.0.1:{mem}",
                                  engine_memory_url=f"http://127.0.0.1:{mem + 1}")
        return self.workers[name]

    def start_proxy(self, *extra: str, name: str = "proxy") -> Proc:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        args = [AGENTSERVING, "proxy", "--port", str(port), "--discovery-interval", "0.3",
                "--kvindex-timeout", "0.5", *extra]
        if self.kvindex is not None and "--kvindex" not in extra:
            args += ["--kvindex", self.kvindex.url]
        log = self.root / f"{name}.log"
        proc = self.stack.enter_context(service_process(args, url + "/healthz", env=self.env,
                                                        log_path=log))
        return Proc(url, proc, log)


@pytest.fixture(scope="module")
def fleet_factory(tmp_path_factory):
    with contextlib.ExitStack() as stack:
        yield Fleet(tmp_path_factory.mktemp("fleet"), stack)
