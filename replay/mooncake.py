"""Reader for the Mooncake FAST'25 trace format, as agent sessions.

Each line of a Mooncake trace is one request: ``{"timestamp": ms, "input_length": tokens,
"output_length": tokens, "hash_ids": [...]}``, where ``hash_ids`` name the prompt's 512-token
blocks (two requests sharing their first k ids share their first k*512 tokens). The trace has
no session ids, so this reader recovers conversations from the prefix structure:

**Grouping rule.** Requests are taken in timestamp order. For each one, find the earlier
requests with which it shares the longest run of leading ``hash_ids``. If that run is shorter
than ``min_shared_blocks`` blocks (default 2), the request starts a new session. Otherwise its
parent is, among those requests, the latest one it *extends* (whose full blocks it all
shares: the old prompt is a prefix of the new one but for the old, trimmed last block), or the
latest one if it extends none. The request becomes the parent's next turn when it extends the
parent and the parent is still its session's latest turn; otherwise it is a branch (a new
session whose ``parent`` is that turn): a conversation that diverged inside an earlier prompt
(an edited or regenerated message) or that went on twice from the same turn. The threshold is
2 because every request of the public conversation trace begins with block 0 — a system prompt
common to all 12,031 requests — so sharing it alone says nothing about the conversation;
sharing a second block means sharing at least 512 tokens of user content. On the full trace
this gives 7,373 sessions plus 701 branches (mean 1.49 turns per session, up to 43; 2,046
sessions have more than one turn), with a median of 123 s between a session's turns.

**Tokens.** Every block id expands to a fixed run of ``block_tokens`` token ids (the same id
always gives the same tokens; ``agentserving.replay.tokens``); the last block is trimmed so
the prompt has ``input_length`` tokens. Turns use ``context: "replace"`` since the trace
records whole prompts. ``block_tokens`` below 512 scales every prompt down by the same factor
while keeping which requests share which prefix (the last, partial block is scaled too) — the
way to replay the trace on hardware that cannot prefill 12k-token prompts quickly. Keep it a
multiple of the engine's chunk size so that shared blocks stay whole chunks.

Every session's ``meta.source`` is ``"mooncake"``.

**Time.** A turn's ``timestamp_s`` is the request's timestamp; the session's ``start_s`` is
its first turn's. Tool gaps are zero: the replay honours the timestamps (scaled with
``--time-scale``) and never starts a turn before the previous one in its session finished.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentserving.replay.trace import (
    ParentRef,
    Session,
    Trace,
    TraceFormatError,
    TraceHeader,
    Turn,
    TurnInput,
    numbered_lines,
)

MOONCAKE_BLOCK = 512
SOURCE = "mooncake"  # every session's meta.source


@dataclass(frozen=True)
class MooncakeRequest:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class MooncakeOptions:
    max_requests: int | None = None  # the first N requests kept (in file order)
    block_tokens: int = MOONCAKE_BLOCK  # tokens one hash block expands to
    max_output_tokens: int | None = None  # cap every output
    max_input_tokens: int | None = None  # drop requests longer than this (before scaling)
    min_shared_blocks: int = 2


def is_mooncake_line(obj: Any) -> bool:
    return isinstance(obj, dict) and "hash_ids" in obj and "input_length" in obj


def iter_requests(path: str | Path) -> Iterator[MooncakeRequest]:
    for lineno, line in numbered_lines(path):
        try:
            obj = json.loads(line)
            req = MooncakeRequest(int(obj["timestamp"]), int(obj["input_length"]),
                                  int(obj["output_length"]),
                                  tuple(int(h) for h in obj["hash_ids"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise TraceFormatError(f"{path}:{lineno}: not a Mooncake request: {exc}") from exc
        blocks = -(-req.input_length // MOONCAKE_BLOCK)
        if req.input_length <= 0 or len(req.hash_ids) != blocks:
            raise TraceFormatError(f"{path}:{lineno}: {len(req.hash_ids)} hash_ids for "
                                   f"{req.input_length} tokens (expected {blocks})")
        yield req


def scaled_length(req: MooncakeRequest, block_tokens: int) -> int:
    if block_tokens == MOONCAKE_BLOCK:
        return req.input_length
    full = len(req.hash_ids) - 1
    rest = req.input_length - full * MOONCAKE_BLOCK
    return full * block_tokens + max(1, round(rest * block_tokens / MOONCAKE_BLOCK))


class _PrefixTrie:
    """Block-id paths of the requests seen so far.

    Each node remembers the latest request through it, and the latest request through it
    that a request reaching this node would extend (one whose full blocks all lie on the path
    up to here: its prompt is a prefix of the new one, but for its trimmed last block).
    """

    def __init__(self) -> None:
        self.children: dict[tuple[int, int], int] = {}
        self.last: dict[int, int] = {}
        self.last_extendable: dict[int, int] = {}

    def longest(self, ids: tuple[int, ...]) -> tuple[int, int | None, int | None]:
        """(shared depth, latest request there, latest extendable request there)."""
        node, depth = 0, 0
        for block in ids:
            nxt = self.children.get((node, block))
            if nxt is None:
                break
            node, depth = nxt, depth + 1
        if depth == 0:
            return 0, None, None
        return depth, self.last[node], self.last_extendable.get(node)

    def insert(self, ids: tuple[int, ...], full_blocks: int, request: int) -> None:
        node = 0
        for depth, block in enumerate(ids, 1):
            key = (node, block)
            nxt = self.children.get(key)
            if nxt is None:
                nxt = self.children[key] = len(self.children) + 1
            self.last[nxt] = request
            if depth >= full_blocks:
                self.last_extendable[nxt] = request
            node = nxt


def group_sessions(requests: list[MooncakeRequest], opts: MooncakeOptions) -> Trace:
    trie = _PrefixTrie()
    place: list[tuple[int, int]] = []  # request -> (session index, turn index)
    sessions: list[dict[str, Any]] = []
    for i, req in enumerate(requests):
        shared, latest, extendable = trie.longest(req.hash_ids)
        out = req.output_length
        if opts.max_output_tokens is not None:
            out = min(out, opts.max_output_tokens)
        turn = {"input": TurnInput(length=scaled_length(req, opts.block_tokens),
                                   block_ids=list(req.hash_ids)),
                "context": "replace", "output_tokens": max(1, out),
                "timestamp_s": req.timestamp_ms / 1000.0}
        if shared >= opts.min_shared_blocks and latest is not None:
            who = extendable if extendable is not None else latest
            s_idx, t_idx = place[who]
            if extendable is not None and t_idx == len(sessions[s_idx]["turns"]) - 1:
                sessions[s_idx]["turns"].append(turn)  # the conversation goes on
                place.append((s_idx, t_idx + 1))
            else:  # it diverges inside an earlier turn's prompt, or that turn went on already
                parent = ParentRef(session_id=sessions[s_idx]["session_id"], turn=t_idx)
                sessions.append({"session_id": f"mc{i}", "parent": parent, "turns": [turn],
                                 "start_s": turn["timestamp_s"]})
                place.append((len(sessions) - 1, 0))
        else:
            sessions.append({"session_id": f"mc{i}", "turns": [turn],
                             "start_s": turn["timestamp_s"]})
            place.append((len(sessions) - 1, 0))
        trie.insert(req.hash_ids, req.input_length // MOONCAKE_BLOCK, i)
    header = TraceHeader(block_size=opts.block_tokens, source="mooncake:conversation_trace",
                         generator={"reader": "agentserving.replay.mooncake",
                                    "max_requests": opts.max_requests,
                                    "block_tokens": opts.block_tokens,
                                    "max_output_tokens": opts.max_output_tokens,
                                    "max_input_tokens": opts.max_input_tokens,
                                    "min_shared_blocks": opts.min_shared_blocks})
    return Trace(header=header, sessions=[
        Session(session_id=s["session_id"], parent=s.get("parent"), start_s=s["start_s"],
                turns=[Turn(**t) for t in s["turns"]], meta={"source": SOURCE})
        for s in sessions])


def read_mooncake(path: str | Path, opts: MooncakeOptions | None = None) -> Trace:
    """A Mooncake trace file as sessions (see the module docstring for the rule)."""
    opts = opts or MooncakeOptions()
    if opts.block_tokens <= 0 or opts.block_tokens > MOONCAKE_BLOCK:
        raise ValueError(f"block_tokens must be in 1..{MOONCAKE_BLOCK}")
    requests: list[MooncakeRequest] = []
    for req in iter_requests(path):
        if opts.max_requests is not None and len(requests) >= opts.max_requests:
            break
        if opts.max_input_tokens is not None and req.input_length > opts.max_input_tokens:
            continue
        requests.append(req)
    requests.sort(key=lambda r: r.timestamp_ms)  # stable: file order on ties
    return group_sessions(requests, opts)
