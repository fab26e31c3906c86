"""The agent-session trace format (``agentserving.sessions/v1``) and its resolution to tokens.

A trace is a JSONL file. The first line may be a header, ``{"header": {...}}``; every other
line is one session. A session is what one agent did: an ordered list of turns, each turn one
model call. Example (one line each, wrapped here)::

    {"header": {"format": "agentserving.sessions/v1", "block_size": 256, "vocab_size": 32000,
                "source": "synthetic:bench-small", "generator": {"seed": 7}}}
    {"session_id": "s0", "start_s": 0.0, "turns": [
       {"input": {"length": 900, "block_ids": ["sys/coder/0", "sys/coder/1", "sys/coder/2"]},
        "output_tokens": 24, "tool": "read_file", "tool_gap_s": 0.05},
       {"input": {"length": 412}, "output_tokens": 16, "tool": "bash", "tool_gap_s": 1.2},
       {"input": {"token_ids": [101, 2023, 318]}, "output_token_ids": [40, 41, 42]}]}
    {"session_id": "s0.b1", "parent": {"session_id": "s0", "turn": 1, "gap_s": 0.0},
     "turns": [{"input": {"length": 200}, "output_tokens": 16}]}

Header (all optional): ``block_size`` (tokens per shared block, default 512), ``vocab_size``
(token ids are drawn from ``[16, vocab_size)``, default 32000), ``source`` and ``generator``
(free-form provenance: where the trace came from, with which parameters).

Session: ``session_id`` (unique in the file); ``start_s`` (arrival, seconds after the trace
starts; used with ``--timestamps``); ``parent`` (a branch: ``{"session_id", "turn", "gap_s"}``
— the session starts from its parent's context as it stood after the parent's turn ``turn``
(0-based; prompt and output), ``gap_s`` seconds after that turn finished; the parent must
come earlier in the file); ``turns``; ``meta`` (free-form).

Turn: ``input`` — what the turn appends to the context: either ``{"token_ids": [...]}``, or
``{"length": n, "block_ids": [...]}``: the named shared blocks in order (each ``block_size``
tokens, the last one trimmed to fit ``length``), then new tokens that belong to this turn
alone up to ``length``; or ``{"parts": [...]}``, a list of inputs of those two forms whose
tokens follow each other in order. Parts let shared text come *after* a turn's own text (a
task between a shared system prompt and shared instructions): every session gets the same
tokens there, yet a prefix cache cannot reuse them, since what comes before differs.
``output_tokens`` (how many tokens the model emits) or
``output_token_ids`` (exactly which). ``tool`` and ``tool_gap_s``: the tool this turn's output
calls and how long it runs, i.e. the pause between this turn's end and the next turn's start.
``timestamp_s``: the turn's planned start (seconds after the trace starts; with
``--timestamps`` it never starts earlier, and never before its previous turn ended plus the
gap). ``context``: ``"append"`` (default; the prompt is the previous prompt, plus the
previous turn's output, plus this input) or ``"replace"`` (the prompt is this input alone —
for traces such as Mooncake's that record whole prompts). ``meta``: free-form (importers
keep a turn's reference figures there, e.g. the provider's billed prompt and cache-hit tokens).

Session ``meta.source`` names where a session comes from (``mini-swe-agent``, ``mtrag``,
``mooncake``): the replay reports its results per source.

Resolution. Every token of a trace is fixed by the file alone (``agentserving.replay.tokens``):
blocks expand by their id, a turn's new input by ``(session, turn)`` (part ``j`` of a
``parts`` input by ``(session, turn, j)``), and an output given as a length by ``(session,
turn)`` too. So a turn's prompt is

    prompt[k+1] = prompt[k] + output[k] + input[k+1]          (context "append")

and the replay client sends exactly these token ids with ``forced_output_token_ids =
output[k]`` (teacher forcing): every run, against every system, sends the same tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from agentserving.replay.tokens import DEFAULT_VOCAB_SIZE, block_tokens, unique_tokens

FORMAT = "agentserving.sessions/v1"


class TraceFormatError(ValueError):
    """A trace file that does not follow the format; the message names the line."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TraceHeader(_Model):
    format: Literal["agentserving.sessions/v1"] = FORMAT
    block_size: int = Field(default=512, gt=0, description="Tokens per shared block.")
    vocab_size: int = Field(default=DEFAULT_VOCAB_SIZE, gt=16,
                            description="Token ids are drawn from [16, vocab_size).")
    source: str = ""
    generator: dict[str, Any] = Field(default_factory=dict)


class InputPart(_Model):
    """Explicit token ids, or a length made of shared blocks + new tokens."""

    token_ids: list[int] | None = None
    length: int | None = Field(default=None, ge=0)
    block_ids: list[int | str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _one_form(self) -> InputPart:
        forms = (self.token_ids is not None) + (self.length is not None) + \
            (getattr(self, "parts", None) is not None)
        if forms != 1:
            raise ValueError("give exactly one of token_ids or length"
                             + (" or parts" if isinstance(self, TurnInput) else ""))
        if self.length is None and self.block_ids:
            raise ValueError("block_ids go with length")
        if self.token_ids is not None and any(t < 0 for t in self.token_ids):
            raise ValueError("token ids must be non-negative")
        return self

    def num_tokens(self) -> int:
        return len(self.token_ids) if self.token_ids is not None else int(self.length or 0)


class TurnInput(InputPart):
    """What a turn appends: one input form, or ``parts`` (several, concatenated in order)."""

    parts: list[InputPart] | None = Field(default=None, min_length=1)

    def num_tokens(self) -> int:
        if self.parts is not None:
            return sum(p.num_tokens() for p in self.parts)
        return super().num_tokens()

    def forms(self) -> list[tuple[str, InputPart]]:
        """(key suffix, form) per part: ``""`` for a single form, ``"/j"`` for part j."""
        if self.parts is None:
            return [("", self)]
        return [(f"/{j}", part) for j, part in enumerate(self.parts)]


class Turn(_Model):
    input: TurnInput
    context: Literal["append", "replace"] = "append"
    output_tokens: int | None = Field(default=None, ge=1)
    output_token_ids: list[int] | None = Field(default=None, min_length=1)
    tool: str | None = Field(default=None, description="Tool called after this turn.")
    tool_gap_s: float = Field(default=0.0, ge=0, description="Pause before the next turn.")
    timestamp_s: float | None = Field(default=None, ge=0)
    meta: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_output(self) -> Turn:
        if (self.output_tokens is None) == (self.output_token_ids is None):
            raise ValueError("give exactly one of output_tokens or output_token_ids")
        return self

    def num_output_tokens(self) -> int:
        if self.output_token_ids is not None:
            return len(self.output_token_ids)
        return int(self.output_tokens or 0)


class ParentRef(_Model):
    session_id: str
    turn: int = Field(ge=0, description="The parent's turn (0-based) after which this forks.")
    gap_s: float = Field(default=0.0, ge=0, description="Pause after that turn finished.")


class Session(_Model):
    session_id: str = Field(min_length=1, max_length=256)
    parent: ParentRef | None = None
    start_s: float | None = Field(default=None, ge=0)
    turns: list[Turn] = Field(min_length=1)
    meta: dict[str, Any] = Field(default_factory=dict)

    def planned_start_s(self) -> float | None:
        return self.start_s if self.start_s is not None else self.turns[0].timestamp_s


class Trace(_Model):
    header: TraceHeader = Field(default_factory=TraceHeader)
    sessions: list[Session]

    @model_validator(mode="after")
    def _check_references(self) -> Trace:
        seen: dict[str, Session] = {}
        for i, session in enumerate(self.sessions):
            if session.session_id in seen:
                raise ValueError(f"sessions[{i}]: duplicate session_id {session.session_id!r}")
            if session.parent is not None:
                parent = seen.get(session.parent.session_id)
                if parent is None:
                    raise ValueError(f"sessions[{i}]: parent {session.parent.session_id!r} "
                                     "must appear earlier in the trace")
                if session.parent.turn >= len(parent.turns):
                    raise ValueError(f"sessions[{i}]: parent turn {session.parent.turn} out of "
                                     f"range ({len(parent.turns)} turns)")
            for k, turn in enumerate(session.turns):
                for suffix, inp in turn.input.forms():
                    if inp.length is not None and inp.block_ids:
                        needed = -(-inp.length // self.header.block_size)
                        if len(inp.block_ids) > needed:
                            where = f".parts[{suffix[1:]}]" if suffix else ""
                            raise ValueError(
                                f"sessions[{i}].turns[{k}].input{where}: {len(inp.block_ids)} "
                                f"blocks of {self.header.block_size} for {inp.length} tokens")
            seen[session.session_id] = session
        return self

    @property
    def num_turns(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def limit(self, n: int | None) -> Trace:
        """The first ``n`` root sessions (tasks), each with its branches."""
        if n is None or n >= sum(1 for s in self.sessions if s.parent is None):
            return self
        kept: list[Session] = []
        ids: set[str] = set()
        roots = 0
        for session in self.sessions:
            if session.parent is None:
                if roots >= n:
                    continue
                roots += 1
            elif session.parent.session_id not in ids:
                continue
            kept.append(session)
            ids.add(session.session_id)
        return Trace(header=self.header, sessions=kept)


# ------------------------------------------------------------------------------------- files


def numbered_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """The non-blank lines of a JSONL file, numbered from 1: the number a format error names."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                yield lineno, line


def read_trace(path: str | Path) -> Trace:
    """Read an ``agentserving.sessions/v1`` JSONL file; errors name the offending line."""
    header = TraceHeader()
    sessions: list[Session] = []
    for lineno, line in numbered_lines(path):
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise ValueError("each line must be a JSON object")
            if "header" in obj:
                if sessions:
                    raise ValueError("the header must be the first line")
                header = TraceHeader.model_validate(obj["header"])
            else:
                sessions.append(Session.model_validate(obj))
        except (ValueError, ValidationError) as exc:
            raise TraceFormatError(f"{path}:{lineno}: {exc}") from exc
    try:
        return Trace(header=header, sessions=sessions)
    except ValidationError as exc:
        raise TraceFormatError(f"{path}: {exc}") from exc


def dump_lines(trace: Trace) -> Iterator[str]:
    yield json.dumps({"header": trace.header.model_dump(mode="json")}, separators=(",", ":"))
    for session in trace.sessions:
        yield json.dumps(session.model_dump(mode="json", exclude_defaults=True),
                         separators=(",", ":"))


def write_trace(trace: Trace, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for line in dump_lines(trace):
            f.write(line + "\n")
    return path


# ------------------------------------------------------------------------------- resolution


@dataclass(frozen=True)
class ResolvedTurn:
    """One turn as the replay client sends it."""

    session_id: str
    index: int
    prompt: list[int]
    forced_output: list[int]
    appended: int  # tokens this turn added to the context
    tool: str | None
    tool_gap_s: float
    timestamp_s: float | None


@dataclass(frozen=True)
class ResolvedSession:
    session: Session
    turns: list[ResolvedTurn]


def expand_input(inp: TurnInput, key: str, *, block_size: int, vocab_size: int) -> list[int]:
    """A turn's input as token ids; ``key`` names its own tokens (``input/{sid}/{k}``; part
    j's are ``{key}/{j}``)."""
    if inp.parts is not None:
        return [t for suffix, part in inp.forms()
                for t in _expand_form(part, key + suffix, block_size, vocab_size)]
    return _expand_form(inp, key, block_size, vocab_size)


def _expand_form(inp: InputPart, key: str, block_size: int, vocab_size: int) -> list[int]:
    if inp.token_ids is not None:
        return list(inp.token_ids)
    length = int(inp.length or 0)
    tokens: list[int] = []
    for block_id in inp.block_ids:
        take = min(block_size, length - len(tokens))
        if take <= 0:
            break
        tokens += block_tokens(block_id, take, block_size=block_size, vocab_size=vocab_size)
    if len(tokens) < length:
        tokens += unique_tokens(key, length - len(tokens), vocab_size=vocab_size)
    return tokens


def forced_output(turn: Turn, key: str, *, vocab_size: int) -> list[int]:
    if turn.output_token_ids is not None:
        return list(turn.output_token_ids)
    return unique_tokens(key, int(turn.output_tokens or 0), vocab_size=vocab_size)


def resolve(trace: Trace, *, vocab_size: int | None = None) -> Iterator[ResolvedSession]:
    """Every session's turns as token ids, in file order (see the module docstring)."""
    vocab = vocab_size or trace.header.vocab_size
    block_size = trace.header.block_size
    fork_points = {(s.parent.session_id, s.parent.turn) for s in trace.sessions if s.parent}
    fork_contexts: dict[tuple[str, int], list[int]] = {}
    for session in trace.sessions:
        sid = session.session_id
        context: list[int] = []
        if session.parent is not None:
            context = list(fork_contexts[(session.parent.session_id, session.parent.turn)])
        turns: list[ResolvedTurn] = []
        for k, turn in enumerate(session.turns):
            appended = expand_input(turn.input, f"input/{sid}/{k}", block_size=block_size,
                                    vocab_size=vocab)
            prompt = appended if turn.context == "replace" else context + appended
            output = forced_output(turn, f"output/{sid}/{k}", vocab_size=vocab)
            turns.append(ResolvedTurn(sid, k, prompt, output, len(appended), turn.tool,
                                      turn.tool_gap_s, turn.timestamp_s))
            context = prompt + output
            if (sid, k) in fork_points:
                fork_contexts[(sid, k)] = context
        yield ResolvedSession(session, turns)


def resolve_all(trace: Trace, *, vocab_size: int | None = None) -> list[ResolvedSession]:
    return list(resolve(trace, vocab_size=vocab_size))


def sessions_from(items: Iterable[Session | dict[str, Any]], **header: Any) -> Trace:
    """Build a validated trace from sessions (or their dicts); ``header`` fields by keyword."""
    return Trace(header=TraceHeader(**header),
                 sessions=[s if isinstance(s, Session) else Session.model_validate(s)
                           for s in items])
