"""Scheduling policies: each engine step asks one for what to run.

The engine process runs a step loop (``engine.core.EngineCore.step``). Every step it hands
the policy the queue (``waiting``, oldest first), the requests holding KV (``running``) and a
``SchedulerContext``, and gets back a ``StepPlan``: which requests prefill how many prompt
tokens this step, and which decode one token. The engine then executes the plan, fetching a
request's cached prefix from the KV tiers the first time it is scheduled.

Rules the engine enforces whatever the policy says (so reused KV stays bit-identical to a
recompute; see ``model.runner``): a prefill budget is rounded down to a multiple of
``chunk_size`` (at least one chunk), a step never crosses from a prompt's full chunks into its
trailing partial chunk, and a request is admitted only while fewer than ``max_running``
requests hold KV.

New policies (Longcap-FCFS, Dynamic Chunk, the ShadowScheduler in ``services/prefill``)
implement ``SchedulerPolicy``; ``registry.make_policy`` builds the one the settings name.
A policy may also define ``observe_step(plan, seconds)``: the engine calls it after executing
each plan with the plan's wall time (for step-time models).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from agentserving.core.hashing import DEFAULT_CHUNK_SIZE
from agentserving.core.schemas import Tier
from agentserving.engine.scheduler.request import EngineRequest, RequestState


@dataclasses.dataclass
class PrefillWork:
    request: EngineRequest
    num_tokens: int  # the token budget for this step (the engine aligns it)


@dataclasses.dataclass
class StepPlan:
    prefill: list[PrefillWork] = dataclasses.field(default_factory=list)
    decode: list[EngineRequest] = dataclasses.field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


@dataclasses.dataclass
class SchedulerContext:
    chunk_size: int
    max_running: int
    now: float = dataclasses.field(default_factory=time.time)
    # For policies that look ahead: the tiers holding a request's cached prefix (no I/O),
    # and a way to start moving chunks disk -> DRAM before the request is scheduled.
    lookup_tiers: Callable[[EngineRequest], list[Tier]] = lambda _r: []
    prefetch: Callable[[list[str]], None] = lambda _h: None


class SchedulerPolicy(Protocol):
    name: str

    def schedule(self, waiting: Sequence[EngineRequest], running: Sequence[EngineRequest],
                 ctx: SchedulerContext) -> StepPlan: ...


class FcfsPolicy:
    """First come, first served, with a fixed prefill chunk.

    Each step: every decoding request decodes one token, and the oldest request with prompt
    tokens left (one already prefilling first, else the head of the queue if there is room)
    prefills up to ``chunk_tokens`` of them.

    ``decode_steps`` (k >= 1) is for pods that mostly decode but prefill some turns themselves
    (decode pods under the proxy's conditional disaggregation): while requests are decoding,
    each step that prefills is followed by k - 1 decode-only steps. A step with a chunk costs
    the decoding requests the chunk's whole compute for one token; with k steps per chunk they
    get k tokens for it, and the prefill waits k - 1 cheap decode steps per chunk.
    """

    name = "fcfs"

    def __init__(self, chunk_tokens: int = 512, decode_steps: int = 1) -> None:
        if decode_steps < 1:
            raise ValueError("decode_steps must be at least 1")
        self.chunk_tokens = chunk_tokens
        self.decode_steps = decode_steps
        self._decode_only = 0  # decode-only steps still owed after the last prefilling step

    def schedule(self, waiting: Sequence[EngineRequest], running: Sequence[EngineRequest],
                 ctx: SchedulerContext) -> StepPlan:
        plan = StepPlan(decode=[r for r in running if r.state is RequestState.DECODING])
        if plan.decode and self._decode_only > 0:
            self._decode_only -= 1
            return plan
        prefilling = [r for r in running if r.state is RequestState.PREFILLING]
        if prefilling:
            target = min(prefilling, key=lambda r: r.arrival_time)
            plan.prefill.append(PrefillWork(target, self.chunk_tokens))
        elif waiting and len(running) < ctx.max_running:
            plan.prefill.append(PrefillWork(waiting[0], self.chunk_tokens))
        self._decode_only = self.decode_steps - 1 if plan.prefill else 0
        return plan


# What a decode pod runs when the proxy sends it whole turns (conditional disaggregation): one
# KV chunk, then two decode-only steps. The bench's decode pods and the simulator's
# model of them both take it from here.
DECODE_POD_POLICY = "fcfs?decode_steps=3"
DECODE_POD_CHUNK_TOKENS = DEFAULT_CHUNK_SIZE
