"""The ideal prefix hit rate of a trace: what an unbounded cache would reuse.

Turns are taken in their planned order (each session starting at its planned arrival, each turn
after the previous one's tool gap, as if the model answered instantly; sessions without a start
time keep file order). A turn's reusable tokens are the leading full chunks of its prompt
(``chunk_size`` tokens each, chained: a chunk counts only if every chunk before it does too)
that some earlier turn already computed — its prompt and, with ``include_outputs``, the output
it generated (all but the last output token, whose KV an engine never computes). At least one
prompt token is always recomputed (an engine needs one to produce logits), so a prompt that is
an exact multiple of the chunk size can reuse at most all chunks but the last.

This is the bound the system under test is measured against: ``prefix_hit_rate /
ideal_hit_rate``. It depends on the chunk size (only whole chunks are cached) and on nothing
about the serving system.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from agentserving.core.hashing import DEFAULT_CHUNK_SIZE
from agentserving.replay.trace import ResolvedSession, ResolvedTurn

T = TypeVar("T")


@dataclass(frozen=True)
class IdealResult:
    prompt_tokens: int
    reusable_tokens: int
    per_turn: dict[tuple[str, int], int]  # (session_id, turn) -> reusable tokens

    @property
    def hit_rate(self) -> float:
        return self.reusable_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def planned_schedule(sessions: Iterable[tuple[str, tuple[str, int, float] | None, float,
                                                Sequence[T]]]) -> list[T]:
    """Turns sorted by planned start (zero service time), ties in session then turn order.

    Each session is ``(session_id, parent, start_s, turns)`` with ``parent`` as
    ``(parent_session_id, parent_turn, gap_s)``; a turn needs ``index``, ``timestamp_s`` and
    ``tool_gap_s``. Shared by the replay's ideal hit rate and the simulator's.
    """
    planned: dict[tuple[str, int], float] = {}
    keyed: list[tuple[float, int, int, T]] = []
    for order, (session_id, parent, start_s, turns) in enumerate(sessions):
        t = start_s
        if parent is not None:
            t = max(planned[(parent[0], parent[1])] + parent[2], start_s)
        for turn in turns:
            if turn.timestamp_s is not None:
                t = max(t, turn.timestamp_s)
            planned[(session_id, turn.index)] = t
            keyed.append((t, order, turn.index, turn))
            t += turn.tool_gap_s
    keyed.sort(key=lambda x: (x[0], x[1], x[2]))
    return [k[3] for k in keyed]


def planned_order(sessions: list[ResolvedSession]) -> list[ResolvedTurn]:
    """A trace's turns sorted by planned start (zero service time), ties in file order."""
    return planned_schedule(
        (rs.session.session_id,
         (rs.session.parent.session_id, rs.session.parent.turn, rs.session.parent.gap_s)
         if rs.session.parent is not None else None,
         rs.session.planned_start_s() or 0.0, rs.turns)
        for rs in sessions)


def _chain(tokens: list[int], chunk_size: int) -> list[bytes]:
    n = len(tokens) // chunk_size
    if n == 0:
        return []
    data = np.asarray(tokens[: n * chunk_size], dtype="<u4").tobytes()
    step = 4 * chunk_size
    out, prev = [], b""
    for i in range(n):
        prev = hashlib.blake2b(prev + data[i * step:(i + 1) * step], digest_size=16).digest()
        out.append(prev)
    return out


def ideal_hit(sessions: Iterable[ResolvedSession], *, chunk_size: int = DEFAULT_CHUNK_SIZE,
              include_outputs: bool = True) -> IdealResult:
    ordered = planned_order(list(sessions))
    seen: set[bytes] = set()
    per_turn: dict[tuple[str, int], int] = {}
    prompt_total = reusable_total = 0
    for turn in ordered:
        chain = _chain(turn.prompt, chunk_size)
        limit = (len(turn.prompt) - 1) // chunk_size  # keep one token to compute
        hit = 0
        while hit < min(len(chain), limit) and chain[hit] in seen:
            hit += 1
        per_turn[(turn.session_id, turn.index)] = hit * chunk_size
        prompt_total += len(turn.prompt)
        reusable_total += hit * chunk_size
        stored = turn.prompt + turn.forced_output[:-1] if include_outputs else turn.prompt
        seen.update(_chain(stored, chunk_size))
    return IdealResult(prompt_total, reusable_total, per_turn)
