"""Starting real servers on loopback for tests and benchmarks: free ports, service processes,
Redis (plain, with a replica, under Sentinel), waiting for a condition, importing a bench."""

from __future__ import annotations

import contextlib
import importlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import httpx

from agentserving.core.ports import bindable, pickable_ports
from agentserving.core.schemas import (
    MemoryEvictRequest,
    MemoryPinRequest,
    MemoryPrefetchRequest,
    MemoryUnpinRequest,
)

_handed_out: set[int] = set()


# the `agentserving` console script of the interpreter running the tests (its venv)
AGENTSERVING = str(Path(sys.executable).parent / "agentserving")


def free_port() -> int:
    """A loopback port that is free now and that the kernel will not hand to a client socket.

    A port from ``bind(0)`` lies in the ephemeral range, so between this call and the server's
    own bind any outgoing connection (an HTTP client, a Redis connection) may take it as its
    source port: CI saw a worker's memory API fail with EADDRINUSE that way. Ports below the
    ephemeral range are only ever taken by an explicit bind; a random pick among them, never
    the same one twice in a process, keeps concurrent test processes apart too.
    """
    candidates = pickable_ports()
    for _ in range(1000):
        port = random.choice(candidates)
        if port not in _handed_out and bindable(port):
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free port in {candidates.start}-{candidates.stop - 1}")


def wait_for_http(url: str, timeout_s: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    """Poll ``url`` until it answers 2xx; fail early if ``proc`` exits."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} was ready")
        try:
            if httpx.get(url, timeout=1.0).is_success:
                return
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {timeout_s}s: {last}")


def wait_for_port(port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise TimeoutError(f"port {port} not open after {timeout_s}s")


class RedisServer:
    """A private redis-server on a free loopback port, without persistence; stop() kills it."""

    def __init__(self, port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not found: run `make setup` (installs Debian's)")
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="agentserving-redis-")
        self.proc = subprocess.Popen(
            [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
             "--appendonly", "no", "--dir", self.dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_for_port(self.port)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def restart(self) -> None:
        """Start again on the same port (an outage and recovery, as tests need)."""
        self.stop()
        self.__init__(self.port)  # type: ignore[misc]


@contextlib.contextmanager
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def redis_process(port: int, workdir: Path, *args: str) -> Iterator[subprocess.Popen]:
    """A redis-server (or, with ``conf --sentinel``, a sentinel) on loopback, no persistence."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server not found: run `make setup` (installs Debian's)")
    proc = subprocess.Popen([binary, *args, "--bind", "127.0.0.1", "--port", str(port),
                             "--dir", str(workdir), "--save", "", "--appendonly", "no",
                             "--repl-diskless-sync-delay", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port)
        yield proc
    finally:
        proc.kill()
        proc.wait()


def wait_until(check, timeout_s: float = 15.0, what: str = "condition",  # type: ignore[no-untyped-def]
               ignoring: tuple[type[Exception], ...] | None = None, interval_s: float = 0.05):
    """Poll ``check`` until it returns something true, and return that; ``ignoring``: errors
    that mean "not yet" (default: Redis's, as a store comes back after a failover)."""
    if ignoring is None:
        import redis

        ignoring = (redis.RedisError,)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(*ignoring):
            if value := check():
                return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out waiting for {what}")


@contextlib.contextmanager
def redis_sentinel_set(service: str = "kv") -> Iterator[tuple[str, subprocess.Popen, int]]:
    """A master, two replicas and one sentinel watching them, all synced: (the store's
    ``redis+sentinel://`` URL, the master's process, the sentinel's port)."""
    import redis

    root = Path(tempfile.mkdtemp(prefix="agentserving-sentinel-"))
    master, *replicas, sentinel = (free_port() for _ in range(4))
    for name in ("m", "r0", "r1", "s"):
        (root / name).mkdir()
    conf = root / "s" / "sentinel.conf"
    conf.write_text(f"sentinel monitor {service} 127.0.0.1 {master} 1\n"
                    f"sentinel down-after-milliseconds {service} 1000\n"
                    f"sentinel failover-timeout {service} 3000\n")
    try:
        with contextlib.ExitStack() as stack:
            m = stack.enter_context(redis_process(master, root / "m"))
            for i, port in enumerate(replicas):
                stack.enter_context(redis_process(port, root / f"r{i}", "--replicaof",
                                                  "127.0.0.1", str(master)))
            stack.enter_context(redis_process(sentinel, root / "s", str(conf), "--sentinel"))
            primary = redis.Redis(port=master)
            wait_until(lambda: [primary.info("replication").get(f"slave{i}", {}).get("state")
                                for i in range(2)] == ["online", "online"], 20,
                       "both replicas to sync")
            watcher = redis.Redis(port=sentinel)
            wait_until(lambda: len(watcher.sentinel_slaves(service)) == 2, 20,
                       "the sentinel to find both replicas")
            yield f"redis+sentinel://127.0.0.1:{sentinel}/{service}/0", m, sentinel
    finally:
        shutil.rmtree(root, ignore_errors=True)


def import_bench(module: str) -> ModuleType:
    """``bench.<module>`` from this checkout (the benches are not packaged), for its tests.
    The repository root goes at the end of ``sys.path``: first, its operator/ folder would
    shadow the standard library's ``operator``."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "bench" / "__init__.py").exists():
        raise RuntimeError(f"no bench/ in {root}: run from a checkout")
    if str(root) not in sys.path:
        sys.path.append(str(root))
    return importlib.import_module(f"bench.{module}")


def _tail(path: Path | None, lines: int = 40) -> str:
    """The end of a service's log, so a failed start explains itself in the test report."""
    if path is None:
        return "(no log kept: pass log_path)"
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(log unreadable: {exc})"


@contextlib.contextmanager
def service_process(args: list[str], ready_url: str, env: dict[str, str] | None = None,
                    log_path: Path | None = None, timeout_s: float = 60.0
                    ) -> Iterator[subprocess.Popen]:
    """Run a service as a real process until the block ends; its log goes to ``log_path``."""
    log = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(args, env={**os.environ, **(env or {})}, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        try:
            wait_for_http(ready_url, timeout_s, proc)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"{exc}\n--- last lines of {log_path} ---\n{_tail(log_path)}"
                               ) from exc
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if log_path:
            log.close()  # type: ignore[union-attr]


class ThreadedServer:
    """Serve an ASGI app with uvicorn on a loopback port from a background thread."""

    def __init__(self, app, port: int | None = None) -> None:  # type: ignore[no-untyped-def]
        import threading

        import uvicorn

        self.port = port or free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class MemoryApiPeer:
    """A pod's memory API as seen on the wire (seed 000's bodies), served over real HTTP and
    recording each call it gets: what a fan-out sent, without a worker behind it."""

    def __init__(self, delay_s: float = 0.0) -> None:
        import asyncio

        from fastapi import FastAPI

        # the handlers' annotations are strings (``from __future__ import annotations``):
        # FastAPI resolves them in this module's globals, hence the module-level schema import
        self.calls: list[tuple[str, dict]] = []
        app = FastAPI()

        @app.post("/memory/prefetch")
        async def prefetch(req: MemoryPrefetchRequest) -> dict:
            await asyncio.sleep(delay_s)
            self.calls.append(("prefetch", req.model_dump(exclude_none=True)))
            return {"status": "prefetch_started", "lookup_id": req.lookup_id,
                    "num_chunks": len(req.chunk_hashes)}

        @app.post("/memory/evict")
        async def evict(req: MemoryEvictRequest) -> dict:
            self.calls.append(("evict", req.model_dump()))
            return {"status": "success", "num_evicted": len(req.chunk_hashes)}

        @app.post("/memory/pin")
        async def pin(req: MemoryPinRequest) -> dict:
            self.calls.append(("pin", req.model_dump()))
            return {"num_pinned": len(req.chunk_hashes)}

        @app.post("/memory/unpin")
        async def unpin(req: MemoryUnpinRequest) -> dict:
            self.calls.append(("unpin", req.model_dump()))
            return {"num_unpinned": len(req.chunk_hashes)}

        self.server = ThreadedServer(app)

    @property
    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        self.server.stop()


def free_port_run(n: int) -> int:
    """The first of ``n`` consecutive free loopback ports (a worker's memory API needs 2+)."""
    for _ in range(200):
        start = free_port()
        rest = range(start + 1, start + n)
        if all(p not in _handed_out and bindable(p) for p in rest):
            _handed_out.update(rest)
            return start
    raise RuntimeError(f"no run of {n} free ports found")
