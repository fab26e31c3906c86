"""What the fault bench decides, as pure functions: the workload, the fault catalogue, how one
turn's attempts are classified, how outputs are compared, and each fault's figures.

Nothing here starts or kills anything (``bench.fault_injection`` acts, ``bench.fault_client``
sends), so every verdict the bench prints can be unit-tested on hand-made records.

The workload is teacher-forced on the *context* and greedy on the *output*: every turn's
prompt is fixed by the trace (the previous prompt, the trace's own answer, a tool result), and
the model's answer to it is decoded greedily (``temperature: 0``, ``ignore_eos``), not forced.
So a fault-free run and a faulty one send identical prompts whatever fails, and an answer
differs only if the model computed on different KV: a corrupt chunk served, a hand-off
half-applied, a prefix mis-stitched. Forcing the output as well would make every answer
"identical" by construction and hide exactly those.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agentserving.replay.trace import ResolvedTurn, resolve_all, sessions_from

# ------------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Workload:
    sessions: int = 4
    turns: int = 4
    first_tokens: int = 1300  # > 5 chunks of 256: each session leaves files on the disk tier
    append_tokens: int = 300
    output_tokens: int = 16  # a stream long enough to be cut in the middle
    stagger_s: float = 1.5  # session k starts k * stagger_s after the run starts
    think_s: float = 0.3  # the tool's run time between a session's turns


QUICK_WORKLOAD = Workload(sessions=3, turns=3, first_tokens=800, append_tokens=200,
                          output_tokens=12, stagger_s=0.8, think_s=0.2)


def build_turns(w: Workload) -> list[list[ResolvedTurn]]:
    """Every session's turns as token ids (``replay.trace``: the same on every run)."""
    trace = sessions_from([{
        "session_id": f"fault-s{k}", "start_s": k * w.stagger_s,
        "turns": [{"input": {"length": w.first_tokens if t == 0 else w.append_tokens},
                   "output_tokens": w.output_tokens, "tool": "bash", "tool_gap_s": w.think_s}
                  for t in range(w.turns)]} for k in range(w.sessions)],
        block_size=256, source="bench:faults")
    return [rs.turns for rs in resolve_all(trace)]


def request_body(turn: ResolvedTurn, model: str, output_tokens: int) -> dict[str, Any]:
    """The turn as a streamed completion: the trace's prompt, a greedy answer of fixed length
    with its token ids (compared token for token)."""
    return {"model": model, "prompt": turn.prompt, "max_tokens": output_tokens,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
            "stream": True, "stream_options": {"include_usage": True}}


# ------------------------------------------------------------------------------- faults


@dataclass(frozen=True)
class Fault:
    name: str
    what: str
    # when to inject: "decode_streaming" (a turn's tokens are arriving from a decode pod),
    # "prefill_busy" (a P/D turn is on the prefill pod), "after_turns" (N turns done)
    trigger: str
    heal_after_s: float = 2.0  # restart / SIGCONT / free the disk this long after injecting
    needs_root: bool = False
    engines: tuple[str, ...] = ("reference", "vllm")  # the fleets that have what it breaks


FAULTS: dict[str, Fault] = {f.name: f for f in [
    Fault("kill-decode", "kill -9 of a decode pod mid-stream (restarted 2 s later)",
          "decode_streaming"),
    Fault("kill-prefill", "kill -9 of the prefill pod during a P/D hand-off (restarted 2 s "
          "later)", "prefill_busy"),
    Fault("kill-kvindex", "kill -9 of the kvindex (restarted 2 s later)", "after_turns"),
    Fault("kill-redis", "kill -9 of redis-server, AOF on (restarted 2 s later)", "after_turns"),
    Fault("kill-proxy", "kill -9 of the proxy (restarted by the bench 1 s later)",
          "decode_streaming", heal_after_s=1.0),
    Fault("stop-decode", "SIGSTOP of a decode pod mid-stream (SIGCONT 4 s later)",
          "decode_streaming", heal_after_s=4.0),
    Fault("disk-full", "the KV disk tier's filesystem (a tmpfs) filled to ENOSPC, freed 6 s "
          "later", "after_turns", heal_after_s=6.0, needs_root=True),
    Fault("corrupt-disk", "bytes of every stored KV chunk file overwritten (and the chunks "
          "dropped from DRAM, so the next turns read the disk)", "after_turns",
          heal_after_s=0.0),
    Fault("kill-kvserver", "kill -9 of the prefill pod's KV server during a P/D hand-off "
          "(restarted 2 s later)", "prefill_busy", engines=("vllm",)),
    Fault("stop-kvserver", "SIGSTOP of the prefill pod's KV server during a P/D hand-off "
          "(SIGCONT 4 s later)", "prefill_busy", heal_after_s=4.0, engines=("vllm",)),
    Fault("layer-copy", "every layer-wise KV copy into a vLLM pod's pages fails for 6 s (the "
          "failpoint layer_copy; the pods' own prefix caches emptied, so the next turns restore "
          "from LMCache)", "after_turns", heal_after_s=6.0, engines=("vllm",)),
]}

QUICK_FAULTS = ("kill-proxy",)  # the smoke test: one fleet more than the fault-free one


# ------------------------------------------------------------------------------- one turn

# in-band (SSE) errors a client may retry: the proxy's mid-stream failure and the worker's
# own engine-died answer
RETRIABLE_ERROR_TYPES = frozenset({"upstream_error", "service_unavailable"})


@dataclass
class Attempt:
    """One try of one turn, as the client saw it."""

    started: float
    ended: float
    status: int | None = None  # HTTP status; None: no response (connection refused/lost)
    tokens: list[int] = field(default_factory=list)  # streamed before the end
    done: bool = False  # ``data: [DONE]`` arrived
    finished: bool = False  # a choice carried ``finish_reason``
    error_type: str | None = None  # in-band or HTTP error body's ``error.type``
    error_code: str | None = None
    error_message: str | None = None
    transport_error: str | None = None  # exception class: the connection broke
    proxy_retried: list[str] = field(default_factory=list)  # pods the proxy gave up on
    decode_pod: str | None = None
    prefill_pod: str | None = None
    cached_by_tier: dict[str, int] = field(default_factory=dict)  # prompt tokens reused


def attempt_kind(a: Attempt) -> str:
    """``ok``; ``http_error`` (an error status before any byte); ``stream_error`` (an in-band
    error event); ``connection`` (no response, or the connection broke: the client knows);
    ``silent_cut`` (the body ended cleanly without an error, ``[DONE]`` or a finish: the
    client cannot tell a cut answer from a whole one; must never happen)."""
    if a.transport_error is not None:
        return "connection"
    if a.status is not None and a.status != 200:
        return "http_error"
    if a.error_type is not None or a.error_message is not None:
        return "stream_error"
    if a.done and a.finished:
        return "ok"
    return "silent_cut"


def retriable(a: Attempt) -> bool:
    """Whether the failure says "try again": a 5xx/429, a broken connection, an in-band error
    of a retriable type."""
    kind = attempt_kind(a)
    if kind == "connection":
        return True
    if kind == "http_error":
        return a.status is not None and (a.status >= 500 or a.status == 429)
    if kind == "stream_error":
        return a.error_type in RETRIABLE_ERROR_TYPES
    return False


@dataclass
class TurnResult:
    session: int
    turn: int
    attempts: list[Attempt]

    @property
    def final(self) -> Attempt | None:
        ok = [a for a in self.attempts if attempt_kind(a) == "ok"]
        return ok[-1] if ok else None


def turn_outcome(t: TurnResult) -> str:
    """``ok`` (first try, no retry anywhere), ``retried_transparently`` (first try answered,
    the proxy had moved it off a failed pod), ``recovered`` (the client saw a failure, a
    retry succeeded), ``failed`` (never answered within the deadline)."""
    if t.final is None:
        return "failed"
    first = t.attempts[0]
    if attempt_kind(first) == "ok":
        return "retried_transparently" if first.proxy_retried else "ok"
    return "recovered"


def wrong_outputs(results: list[TurnResult], reference: dict[tuple[int, int], list[int]]
                  ) -> list[dict[str, Any]]:
    """Answered turns whose tokens differ from the fault-free run's, with the first
    differing position; and any attempt that *claimed* success with a different answer."""
    out = []
    for t in results:
        want = reference.get((t.session, t.turn))
        for a in t.attempts:
            if attempt_kind(a) != "ok" or want is None or a.tokens == want:
                continue
            pos = next((i for i, (x, y) in enumerate(zip(a.tokens, want, strict=False))
                        if x != y), min(len(a.tokens), len(want)))
            out.append({"session": t.session, "turn": t.turn, "first_diff": pos,
                        "got": a.tokens[:pos + 3], "want": want[:pos + 3],
                        "decode_pod": a.decode_pod})
    return out


def recovery_s(results: list[TurnResult], injected_at: float) -> float | None:
    """From the injection until a turn *sent after it* is answered (the service works
    again); None if none was."""
    ends = [a.ended for t in results for a in t.attempts
            if a.started >= injected_at and attempt_kind(a) == "ok"]
    return round(min(ends) - injected_at, 3) if ends else None


def summarize_fault(name: str, results: list[TurnResult],
                    reference: dict[tuple[int, int], list[int]], injected_at: float | None,
                    healthy_at: float | None, notes: list[str]) -> dict[str, Any]:
    """One fault's row: outcomes by kind, failed attempts by kind, wrong outputs, silent
    cuts, failures after tokens had streamed (and whether each said it was retriable), time
    to a good turn and to a healthy fleet."""
    outcomes = {k: 0 for k in ("ok", "retried_transparently", "recovered", "failed")}
    for t in results:
        outcomes[turn_outcome(t)] += 1
    failed_attempts: dict[str, int] = {}
    after_tokens = {"total": 0, "retriable": 0}
    not_retriable: list[str] = []
    for t in results:
        for a in t.attempts:
            kind = attempt_kind(a)
            if kind == "ok":
                continue
            failed_attempts[kind] = failed_attempts.get(kind, 0) + 1
            if a.tokens:
                after_tokens["total"] += 1
                after_tokens["retriable"] += retriable(a)
            if not retriable(a):
                not_retriable.append(f"s{t.session}t{t.turn}: {kind} {a.status} "
                                     f"{a.error_type} {a.error_message or ''}"[:200])
    wrong = wrong_outputs(results, reference)
    examples = []
    for t in results:
        for a in t.attempts:
            if attempt_kind(a) != "ok" and len(examples) < 3:
                examples.append(f"s{t.session}t{t.turn} {attempt_kind(a)}: "
                                f"{a.error_message or a.transport_error or a.status}"[:240])
    return {
        "fault": name,
        "injected": injected_at is not None,
        "turns": len(results),
        "outcomes": outcomes,
        # the names: turns the fault touched, turns the client never got answered,
        # turns answered after a retry (the proxy's or the client's)
        "turns_affected": len(results) - outcomes["ok"],
        "failed_turns": outcomes["failed"],
        "retried_ok": outcomes["recovered"] + outcomes["retried_transparently"],
        "turns_failed": outcomes["recovered"] + outcomes["failed"],
        "turns_failed_for_good": outcomes["failed"],
        "turns_retried_transparently": outcomes["retried_transparently"],
        "failed_attempts": failed_attempts,
        "failed_after_tokens": after_tokens,
        "silent_cuts": failed_attempts.get("silent_cut", 0),
        "not_retriable_failures": not_retriable,
        "wrong_outputs": len(wrong),
        "wrong_output_examples": wrong[:3],
        "recovery_s": recovery_s(results, injected_at) if injected_at is not None else None,
        "healthy_s": round(healthy_at - injected_at, 3)
        if injected_at is not None and healthy_at is not None else None,
        "error_examples": examples,
        "notes": notes,
    }
