"""Pods that share one host's CPU cores: processor sharing of their engine loops.

On the reference setup every pod is a process on the same machine (``agentserving compare`` on
2 cores runs 3 workers, the proxy, the kvindex and the client there). A worker's engine loop
spins while it has work, so ``n`` busy pods on ``cores`` cores each progress at
``min(1, cores / n)`` of their standalone speed: a step measured alone (``sim calibrate``)
takes ``1 / rate`` times longer in the fleet. Other runnable processes on the host (another
job, the fleet's HTTP processes) count as ``background`` competitors: ``cores / (n + bg)``;
a pod's loop can have more of them than another's (a decode pod's loop also shares its
process with the hand-off pulls), so a job may carry its own ``background``.
Each busy pod holds a job of ``work`` seconds (standalone); whenever a job starts or ends,
every job's remaining work is settled at the old rate and its end rescheduled at the new one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agentserving.sim.events import Event, EventLoop


class Job:
    __slots__ = ("key", "left", "fn", "args", "event", "start", "background")

    def __init__(self, key: Any, work: float, fn: Callable[..., Any], args: tuple,
                 start: float, background: float) -> None:
        self.key, self.left, self.fn, self.args, self.start = key, work, fn, args, start
        self.background = background
        self.event: Event | None = None


class Host:
    def __init__(self, loop: EventLoop, cores: int, background: float = 0.0) -> None:
        self.loop = loop
        self.cores = cores
        self.background = background  # runnable processes from outside the pods' loops
        self.jobs: dict[Any, Job] = {}
        self.last = 0.0
        self.busy_core_s = 0.0        # integral of min(cores, busy pods) dt

    def rate(self, job: Job) -> float:
        """Speed of ``job`` now: the cores shared by the busy loops and the background."""
        return min(1.0, self.cores / (len(self.jobs) + job.background))

    def _settle(self) -> None:
        now = self.loop.now
        elapsed = now - self.last
        if elapsed > 0 and self.jobs:
            for job in self.jobs.values():
                job.left -= elapsed * self.rate(job)
            self.busy_core_s += elapsed * min(self.cores, len(self.jobs))
        self.last = now

    def _reschedule(self) -> None:
        now = self.loop.now
        for job in self.jobs.values():
            if job.event is not None:
                job.event.cancel()
            job.event = self.loop.at(now + max(0.0, job.left) / self.rate(job), self._done,
                                     job)

    def start(self, key: Any, work: float, fn: Callable[..., Any], *args: Any,
              background: float | None = None) -> Job:
        """Run ``work`` standalone seconds for ``key`` (one job per key), then ``fn(*args)``;
        ``background``: this job's competitors besides the busy loops (default: the host's)."""
        self._settle()
        bg = self.background if background is None else background
        job = self.jobs[key] = Job(key, work, fn, args, self.loop.now, bg)
        self._reschedule()
        return job

    def set_left(self, key: Any, left: float) -> None:
        """Shorten ``key``'s job to ``left`` standalone seconds from now."""
        self._settle()
        self.jobs[key].left = left
        self._reschedule()

    def left(self, key: Any) -> float:
        self._settle()
        return self.jobs[key].left

    def _done(self, job: Job) -> None:
        self._settle()
        del self.jobs[job.key]
        self._reschedule()
        job.fn(*job.args)
