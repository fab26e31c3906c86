"""The pure scheduling vocabulary: a snapshot of the queue in, a decision out.

Nothing here imports the engine, vLLM or the simulator; each caller translates its own request
objects into ``ReqView`` and executes the ``Decision`` its own way
(``engine.scheduler.prefill_policies`` for the reference engine, ``vllm_plugin`` for vLLM, the
cluster simulator directly).

Token accounting: ``computed`` counts the tokens whose KV the pod holds for a request (a
reused cached prefix included). For a waiting request it is the number of tokens the policy
*expects* to be restored from the KV tiers on admission (``cached``); if the restore turns out
shorter, the request simply has more to compute — correctness never depends on the estimate.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class ReqView:
    req_id: str
    arrival: float
    prompt_len: int
    computed: int = 0          # tokens with KV on the pod (waiting: expected cached prefix)
    decode_left: int = 0       # tokens still to decode on this pod (0 on a prefill-only pod)
    running: bool = False      # holds KV on the pod (admitted)
    disk_chunks: tuple[str, ...] = ()  # chunk hashes of the cached prefix that sit on disk

    @property
    def remaining(self) -> int:
        return max(0, self.prompt_len - self.computed)

    @property
    def prefilling(self) -> bool:
        return self.remaining > 0

    @property
    def decoding(self) -> bool:
        return self.running and self.remaining == 0 and self.decode_left > 0

    @property
    def peak_tokens(self) -> int:
        """The most KV tokens this request will ever hold on the pod."""
        return self.prompt_len + self.decode_left


@dataclasses.dataclass(frozen=True)
class SchedState:
    waiting: tuple[ReqView, ...]   # oldest first
    running: tuple[ReqView, ...]
    max_running: int = 64
    kv_capacity_tokens: int = 1 << 40
    block_size: int = 16
    # Executor rules the policy must respect so that what it plans is exactly what runs:
    quantum: int = 1               # non-final chunk ends on a multiple of this (engine: chunk_size)
    split_tail: bool = False       # the trailing partial chunk is always a step of its own
    now: float = 0.0

    @property
    def capacity_blocks(self) -> int:
        return self.kv_capacity_tokens // self.block_size

    def blocks(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def used_blocks(self) -> int:
        return sum(self.blocks(r.computed) for r in self.running)


@dataclasses.dataclass(frozen=True)
class Decision:
    prefill: tuple[tuple[str, int], ...] = ()   # (req_id, new tokens this step), in run order
    admit: tuple[str, ...] = ()                 # waiting requests admitted this step
    decode: tuple[str, ...] = ()                # running requests decoding one token

    @property
    def new_tokens(self) -> int:
        return sum(n for _, n in self.prefill)


def evolve(obj, **changes):  # noqa: ANN001, ANN201 - ReqView or SchedState in, same out
    """``dataclasses.replace`` for these frozen dataclasses, without its per-call field
    introspection (the planners call it on every grant; ``replace`` was most of their time).
    Fields are copied as they are: no ``__init__`` / ``__post_init__`` runs (neither class
    has one of its own)."""
    new = object.__new__(type(obj))
    d = new.__dict__
    d.update(obj.__dict__)
    d.update(changes)
    return new


def advance(state: SchedState, decision: Decision, *, drop_finished: bool = True) -> SchedState:
    """The state after ``decision`` runs (no new arrivals): prompts advance, decodes grow by one
    token, requests with nothing left to do release their KV."""
    by_id = {r.req_id: r for r in state.running}
    waiting = state.waiting
    if decision.admit:
        admitted = set(decision.admit)
        left = []
        for r in waiting:
            if r.req_id in admitted:
                by_id[r.req_id] = evolve(r, running=True)
            else:
                left.append(r)
        waiting = tuple(left)
    for rid, n in decision.prefill:
        r = by_id[rid]
        by_id[rid] = evolve(r, computed=r.computed + n)
    for rid in decision.decode:
        r = by_id[rid]
        by_id[rid] = evolve(r, computed=r.computed + 1, decode_left=r.decode_left - 1)
    running = tuple(r for r in by_id.values()
                    if not drop_finished or r.computed < r.prompt_len or r.decode_left > 0)
    return evolve(state, waiting=waiting, running=running)
