"""Workloads for the simulator: a replay trace (``agentserving.replay.loader.load_trace``) made
compact — per turn, token counts and the chunk-hash chain of its prompt — without expanding
any token.

Chunk ids are symbolic but follow the real chain exactly: the replay resolves every token from
(shared block id, offset) or (session, turn) keys (``agentserving.replay.tokens``), so a chunk's
content is named by the spans of keys it covers, and ``id_i = H(id_{i-1}, spans_i)`` names a
prefix just as the engine's ``h_i = H(h_{i-1}, tokens_i)`` does: two prompts share chunk i iff
they share their first (i+1)*C tokens (barring hash collisions of the random token streams).
``ideal_cached`` mirrors ``agentserving.replay.ideal`` (unbounded cache, planned order, one
token always computed, outputs stored without their last token).
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass, field

from agentserving.replay.ideal import planned_schedule
from agentserving.replay.trace import InputPart, Trace

Span = tuple[str, int, int]  # (source key, offset in source, length)


@dataclass(slots=True)
class SimTurn:
    session_id: str
    index: int
    prompt_len: int
    output_len: int
    appended: int
    chunks: list[str]          # full-chunk chain of the prompt
    stored_chunks: list[str]   # chain of prompt + output[:-1] (what a pod can keep)
    tool_gap_s: float
    timestamp_s: float | None
    last: bool
    ideal_cached: int = 0


@dataclass(slots=True)
class SimSession:
    session_id: str
    parent: tuple[str, int, float] | None   # (session, turn, gap_s)
    start_s: float | None
    turns: list[SimTurn] = field(default_factory=list)


class _Chain:
    """A context as a chunk chain plus the spans of its trailing partial chunk."""

    __slots__ = ("chunk", "ids", "tail", "tail_len", "length")

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk
        self.ids: list[str] = []
        self.tail: list[Span] = []
        self.tail_len = 0
        self.length = 0

    def copy(self) -> _Chain:
        c = _Chain(self.chunk)
        c.ids, c.tail, c.tail_len, c.length = list(self.ids), list(self.tail), self.tail_len, \
            self.length
        return c

    def append(self, key: str, n: int, offset: int = 0) -> None:
        while n > 0:
            take = min(self.chunk - self.tail_len, n)
            self.tail.append((key, offset, take))
            self.tail_len += take
            self.length += take
            offset += take
            n -= take
            if self.tail_len == self.chunk:
                prev = self.ids[-1] if self.ids else ""
                self.ids.append(hashlib.blake2b(repr((prev, self.tail)).encode(),
                                                digest_size=8).hexdigest())
                self.tail, self.tail_len = [], 0


def compile_trace(trace: Trace, *, chunk: int = 256) -> list[SimSession]:
    """The trace as ``SimSession``s in file order, with every turn's chains and ideal hit."""
    block = trace.header.block_size
    forks = {(s.parent.session_id, s.parent.turn) for s in trace.sessions if s.parent}
    fork_ctx: dict[tuple[str, int], _Chain] = {}
    out: list[SimSession] = []
    for s in trace.sessions:
        sid = s.session_id
        parent = (s.parent.session_id, s.parent.turn, s.parent.gap_s) if s.parent else None
        ctx = fork_ctx[(parent[0], parent[1])].copy() if parent else _Chain(chunk)
        sess = SimSession(sid, parent, s.planned_start_s())
        for k, t in enumerate(s.turns):
            inp = t.input
            if t.context == "replace":
                ctx = _Chain(chunk)
            n = inp.num_tokens()
            for suffix, form in inp.forms():  # one form, or each part of a parts input
                _append_form(ctx, form, f"i:{sid}/{k}{suffix}", block)
            prompt_ids, prompt_len = list(ctx.ids), ctx.length
            out_n = t.num_output_tokens()
            okey = f"oids:{hash_ids(t.output_token_ids)}" if t.output_token_ids else f"o:{sid}/{k}"
            stored = ctx.copy()
            stored.append(okey, out_n - 1)
            ctx.append(okey, out_n)
            sess.turns.append(SimTurn(sid, k, prompt_len, out_n, n, prompt_ids, stored.ids,
                                      t.tool_gap_s, t.timestamp_s, k == len(s.turns) - 1))
            if (sid, k) in forks:
                fork_ctx[(sid, k)] = ctx.copy()
        out.append(sess)
    _ideal(out, chunk)
    return out


def _append_form(ctx: _Chain, form: InputPart, key: str, block: int) -> None:
    n = form.num_tokens()
    if form.token_ids is not None:
        ctx.append(f"ids:{hash_ids(form.token_ids)}", n)
        return
    used = 0
    for b in form.block_ids:
        take = min(block, n - used)
        if take <= 0:
            break
        ctx.append(f"b:{b}", take)
        used += take
    if used < n:
        ctx.append(key, n - used)


def hash_ids(ids: list[int] | None) -> str:
    return hashlib.blake2b(repr(ids).encode(), digest_size=8).hexdigest()


def _ideal(sessions: list[SimSession], chunk: int) -> None:
    keyed = planned_schedule((s.session_id, s.parent, s.start_s or 0.0, s.turns)
                             for s in sessions)
    seen: set[str] = set()
    for turn in keyed:
        limit = min(len(turn.chunks), (turn.prompt_len - 1) // chunk)
        hit = 0
        while hit < limit and turn.chunks[hit] in seen:
            hit += 1
        turn.ideal_cached = hit * chunk
        seen.update(turn.stored_chunks)


def with_poisson_starts(sessions: list[SimSession], rate: float, seed: int) -> None:
    """Root sessions arrive as a seeded Poisson process of ``rate`` per second (in place)."""
    rng = random.Random(f"agentserving.sim/arrivals/{seed}")
    t = 0.0
    first = True
    for s in sessions:
        if s.parent is None:
            if not first:
                t += -math.log(1.0 - rng.random()) / rate
            first = False
            s.start_s = t
