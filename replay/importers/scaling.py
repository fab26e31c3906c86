"""Fitting real sessions to the fleet that replays them: token, output and time scales, the
context cap, the turn cap; and writing them as trace sessions.

A real SWE agent's prompts reach 30-80k tokens and its outputs hundreds; the main job's pods
hold 8,064 tokens and decode slowly on CPUs. Scaling keeps the *shape* (which tokens every turn
reuses, how context grows, how long tools run) while shrinking the sizes: every input part's
length times ``token_scale``, every output times ``output_scale`` (decode is what the CPUs are
slowest at), every time times ``time_scale``; lengths are rounded and at least 1 (a part
that is really empty stays empty). A session is then cut before its first turn whose prompt
plus output would not fit ``max_context`` (a session whose first turn does not fit is
dropped), and kept to its first ``max_turns``. A turn's ``meta`` keeps its real counts.

Shared pieces become blocks ``{namespace}/{digest}/{i}`` of the header's block size (the
engines' 256-token chunk), so every session with the same shared text gets the same tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from agentserving.core.hashing import DEFAULT_CHUNK_SIZE
from agentserving.replay.importers.templated import Piece
from agentserving.replay.trace import InputPart, Session, Trace, TraceHeader, Turn, TurnInput

# the main job's per-pod vLLM context: (64 blocks - 1) * 128 (replay/configs.py)
MAIN_JOB_CONTEXT = 8064


@dataclass(frozen=True)
class Scaling:
    token_scale: float = 1.0
    output_scale: float = 1.0
    time_scale: float = 1.0
    max_context: int | None = None
    max_turns: int | None = None
    max_gap_s: float | None = None  # cap on every scaled pause

    def real(self) -> Scaling:
        """Real sizes and times: scales 1, no context cap (the turn cap stays)."""
        return Scaling(max_turns=self.max_turns)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def scaled(n: int, factor: float) -> int:
    return 0 if n <= 0 else max(1, round(n * factor))


@dataclass
class ImportedTurn:
    pieces: list[Piece]
    output_tokens: int
    tool: str | None = None
    gap_s: float = 0.0  # real seconds until the next call (the tool's run, a human's pause)
    replace: bool = False
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class ImportedSession:
    session_id: str
    start_s: float  # real seconds after the source's earliest session
    turns: list[ImportedTurn]
    meta: dict[str, Any] = field(default_factory=dict)
    clamped: int = 0  # turns whose prompt was shorter than the previous prompt + output


@dataclass
class Fitted:
    sessions: list[Session]
    dropped: int = 0  # sessions whose first turn does not fit the context
    cut: int = 0  # sessions cut short by the context (not by max_turns)
    turns_cut: int = 0  # turns left out by the context cap
    clamped: int = 0  # turns whose input the append rule had to clamp at 0


def turn_input(pieces: list[Piece], factor: float, *, namespace: str,
               block_size: int) -> TurnInput:
    forms = []
    for piece in pieces:
        n = scaled(piece.tokens, factor)
        if piece.shared is None:
            forms.append(InputPart(length=n))
        else:
            blocks = -(-n // block_size)
            forms.append(InputPart(length=n, block_ids=[f"{namespace}/{piece.shared}/{i}"
                                                        for i in range(blocks)]))
    if len(forms) == 1 and not forms[0].block_ids:
        return TurnInput(length=forms[0].length)
    return TurnInput(parts=forms)


def fit_session(session: ImportedSession, scaling: Scaling, *, namespace: str,
                block_size: int) -> tuple[Session | None, int]:
    """The session scaled and capped, and how many turns the context cap left out."""
    turns: list[Turn] = []
    context = 0
    real = session.turns[:scaling.max_turns] if scaling.max_turns else session.turns
    for t in real:
        inp = turn_input(t.pieces, scaling.token_scale, namespace=namespace,
                         block_size=block_size)
        out = scaled(t.output_tokens, scaling.output_scale) or 1
        prompt = inp.num_tokens() + (0 if t.replace else context)
        if scaling.max_context is not None and prompt + out > scaling.max_context:
            break
        gap = t.gap_s * scaling.time_scale
        if scaling.max_gap_s is not None:
            gap = min(gap, scaling.max_gap_s)
        turns.append(Turn(input=inp, context="replace" if t.replace else "append",
                          output_tokens=out, tool=t.tool, tool_gap_s=round(max(0.0, gap), 4),
                          meta=t.meta))
        context = prompt + out
    left_out = len(real) - len(turns)
    if not turns:
        return None, left_out
    return Session(session_id=session.session_id,
                   start_s=round(session.start_s * scaling.time_scale, 4), turns=turns,
                   meta=session.meta), left_out


def fit_sessions(sessions: Iterable[ImportedSession], scaling: Scaling, *, namespace: str,
                 block_size: int = DEFAULT_CHUNK_SIZE) -> Fitted:
    out = Fitted([])
    for session in sessions:
        fitted, left_out = fit_session(session, scaling, namespace=namespace,
                                       block_size=block_size)
        if fitted is None:
            out.dropped += 1
        else:
            out.sessions.append(fitted)
            out.cut += left_out > 0
        out.turns_cut += left_out
        out.clamped += session.clamped
    return out


def trace_of(fitted: Fitted, *, source: str, generator: dict[str, Any],
             block_size: int = DEFAULT_CHUNK_SIZE) -> Trace:
    """The fitted sessions as a trace; the header's generator gets the drop and cut counts."""
    counts = {"sessions_dropped": fitted.dropped, "sessions_cut": fitted.cut,
              "turns_cut": fitted.turns_cut, "inputs_clamped": fitted.clamped}
    return Trace(header=TraceHeader(block_size=block_size, source=source,
                                    generator={**generator, **counts}),
                 sessions=fitted.sessions)
