"""The API process's side of the engine processes: start them, route requests to them,
stream their outputs back, and watch them.

Each engine process is a real ``python -m agentserving.engine.engine_process`` child (its
settings arrive on stdin). Requests go out over a per-engine ZMQ PUSH socket; every engine
pushes outputs, residency changes and stats into one PULL socket read by a single task here,
which dispatches outputs to per-request queues. With several engine processes a request goes
to the one holding the longest prefix of its chunks (from the residency book), ties to the
least loaded. If an engine process dies, every request in flight fails and ``dead`` is set:
the worker then exits (its pod restarts) rather than serve half a pod.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import zmq
import zmq.asyncio

from agentserving.core.logging import get_logger
from agentserving.engine import ipc
from agentserving.engine.metrics import WorkerMetrics
from agentserving.engine.reporter import Change, ResidencyBook
from agentserving.engine.settings import WorkerSettings

log = get_logger(__name__)


class EngineDead(RuntimeError):
    pass


@dataclasses.dataclass
class _Engine:
    index: int
    in_addr: str
    proc: subprocess.Popen
    push: zmq.asyncio.Socket
    ready: ipc.Ready | None = None
    inflight: int = 0


class EngineClient:
    def __init__(self, settings: WorkerSettings, metrics: WorkerMetrics, book: ResidencyBook,
                 on_changes: Callable[[list[Change]], None] | None = None) -> None:
        self.settings = settings
        self.metrics = metrics
        self.book = book
        self.on_changes = on_changes
        self.on_ready: Callable[[ipc.Ready], None] | None = None
        self.engines: list[_Engine] = []
        self.dead: str | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._owner: dict[str, _Engine] = {}
        self._ctx = zmq.asyncio.Context()
        self._dir = Path(tempfile.mkdtemp(prefix="agentserving-worker-"))
        self._out_addr = f"ipc://{self._dir}/out"
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(self._out_addr)
        self._tasks: list[asyncio.Task] = []
        self._ready = asyncio.Event()
        self.died = asyncio.Event()
        self._closing = False

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self.dead is None

    async def wait_ready(self, timeout_s: float) -> bool:
        """Requests that arrive while the engines load wait for them (up to ``timeout_s``)."""
        if not self._ready.is_set() and self.dead is None:
            try:
                await asyncio.wait_for(self._ready.wait(), timeout_s)
            except TimeoutError:
                return False
        return self.ready

    # ------------------------------------------------------------------ lifecycle
    async def start(self, timeout_s: float = 300.0) -> None:
        payload = self.settings.model_dump_json().encode()
        for k in range(self.settings.engine_processes):
            in_addr = f"ipc://{self._dir}/in-{k}"
            push = self._ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.bind(in_addr)
            proc = subprocess.Popen(
                [sys.executable, "-m", "agentserving.engine.engine_process", "--index", str(k),
                 "--in", in_addr, "--out", self._out_addr], stdin=subprocess.PIPE)
            assert proc.stdin is not None
            proc.stdin.write(payload)
            proc.stdin.close()
            self.engines.append(_Engine(k, in_addr, proc, push))
        self._tasks.append(asyncio.create_task(self._read_loop(), name="engine-outputs"))
        self._tasks.append(asyncio.create_task(self._watch_loop(), name="engine-watch"))
        deadline = time.monotonic() + timeout_s
        while not all(e.ready for e in self.engines):
            if self.dead:
                raise EngineDead(self.dead)
            if time.monotonic() > deadline:
                raise EngineDead(f"engines not ready after {timeout_s}s")
            await asyncio.sleep(0.05)
        digests = {e.ready.weights_digest for e in self.engines if e.ready}
        if len(digests) != 1:
            raise EngineDead(f"engine processes hold different weights: {digests}")
        self.book.chunk_bytes = self.engines[0].ready.chunk_bytes  # type: ignore[union-attr]
        if self.on_ready is not None:
            self.on_ready(self.engines[0].ready)
        self._ready.set()

    async def close(self) -> None:
        self._closing = True
        for e in self.engines:
            with contextlib.suppress(Exception):  # never block on a dead peer
                await e.push.send(ipc.encode(ipc.Shutdown()), flags=zmq.NOBLOCK)
        deadline = time.monotonic() + 10
        for e in self.engines:
            while e.proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if e.proc.poll() is None:
                e.proc.terminate()
                try:
                    await asyncio.wait_for(asyncio.to_thread(e.proc.wait), 5)
                except TimeoutError:
                    e.proc.kill()
                    e.proc.wait()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for e in self.engines:
            e.push.close()
        self._pull.close()
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    # ------------------------------------------------------------------ info
    @property
    def ready_info(self) -> ipc.Ready:
        ready = self.engines[0].ready
        assert ready is not None
        return ready

    def memory_urls(self) -> list[str]:
        host = "127.0.0.1" if self.settings.host in ("0.0.0.0", "::") else self.settings.host
        return [f"http://{host}:{self.settings.engine_memory_port(k)}"
                for k in range(self.settings.engine_processes)]

    def capacity_bytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self.engines:
            for tier, n in (e.ready.capacity_bytes if e.ready else {}).items():
                out[tier] = out.get(tier, 0) + n
        return out

    # ------------------------------------------------------------------ requests
    def _pick(self, chunk_hashes: list[str]) -> _Engine:
        if len(self.engines) == 1:
            return self.engines[0]
        prefix = self.book.best_engine(chunk_hashes, [e.index for e in self.engines])
        return max(self.engines, key=lambda e: (prefix.get(e.index, 0), -e.inflight, -e.index))

    async def generate(self, add: ipc.AddRequest,
                       chunk_hashes: list[str]) -> AsyncIterator[ipc.OutputItem]:
        if self.dead:
            raise EngineDead(self.dead)
        engine = self._pick(chunk_hashes)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[add.req_id] = queue
        self._owner[add.req_id] = engine
        engine.inflight += 1
        finished = False
        try:
            await engine.push.send(ipc.encode(add))
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            engine.inflight -= 1
            self._queues.pop(add.req_id, None)
            self._owner.pop(add.req_id, None)
            if not finished and self.dead is None:
                with contextlib.suppress(Exception):
                    await engine.push.send(ipc.encode(ipc.Abort(req_id=add.req_id)),
                                           flags=zmq.NOBLOCK)

    # ------------------------------------------------------------------ background
    async def _read_loop(self) -> None:
        while True:
            data = await self._pull.recv()
            try:
                msg = ipc.decode_from_engine(data)
            except Exception:  # noqa: BLE001
                log.exception("bad_engine_message")
                continue
            if isinstance(msg, ipc.Outputs):
                for item in msg.items:
                    queue = self._queues.get(item.req_id)
                    if queue is not None:
                        queue.put_nowait(item)
            elif isinstance(msg, ipc.Residency):
                changes = self.book.apply(msg.engine, msg.stored, msg.removed)
                for tier, n in self.book.counts().items():
                    self.metrics.kv_chunks.labels(tier.value).set(n)
                for tier, n in self.book.bytes().items():
                    self.metrics.kv_bytes.labels(tier.value).set(n)
                if changes and self.on_changes is not None:
                    self.on_changes(changes)
            elif isinstance(msg, ipc.Stats):
                self.metrics.engine_stats(msg.engine, msg.waiting, msg.running, msg.counters)
            elif isinstance(msg, ipc.Ready):
                self.engines[msg.engine].ready = msg
                for tier, n in self.capacity_bytes().items():
                    self.metrics.kv_capacity.labels(tier).set(n)
                log.info("engine_process_ready", engine=msg.engine, port=msg.memory_port)
            elif isinstance(msg, ipc.Fatal):
                self._die(f"engine {msg.engine} failed: {msg.error}")

    async def _watch_loop(self) -> None:
        while True:
            for e in self.engines:
                code = e.proc.poll()
                if code is not None:
                    self._die(f"engine process {e.index} exited with {code}")
                    return
            await asyncio.sleep(0.25)

    def _die(self, why: str) -> None:
        if self.dead is None and not self._closing:
            log.error("engine_dead", reason=why)
            self.dead = why
            for queue in self._queues.values():
                queue.put_nowait(EngineDead(why))
            self.died.set()
