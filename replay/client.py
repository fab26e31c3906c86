"""The teacher-forced multi-turn replay client.

Contract with the server (an AgentServing proxy or worker, or any OpenAI-compatible server
that implements the ``forced_output_token_ids`` extension):

- every turn is ``POST {target}/v1/completions`` with ``prompt`` as token ids, ``max_tokens``
  and ``forced_output_token_ids`` equal to the turn's output from the trace, ``stream: true``
  with ``stream_options.include_usage``, ``return_token_ids: true`` (vLLM's: each streamed
  choice then carries its ``token_ids``, which are compared with the forced ones; a server
  that sends none is checked by the count alone), and the header ``x-session-id: <session_id>``
  (branches also send ``x-parent-session-id``; a turn whose output calls a tool sends its name
  as ``x-agentserving-next-tool``, which the proxy's tool-gap predictor uses);
- the server streams SSE ``data:`` chunks (``choices[0].text``), then a chunk with ``usage``
  (``prompt_tokens``, ``completion_tokens``, ``prompt_tokens_details.cached_tokens``) and
  ``data: [DONE]``; ``kv_transfer_params.chunk_hashes`` and ``.prompt_sources`` (a vLLM pod
  with AgentServing's connector: where the prompt's tokens came from) may come on any chunk;
- ``x-agentserving-*`` response headers (``-prefill-pod``, ``-decode-pod``) say where it ran.

Timing: root sessions arrive at their trace start times (``start_s``, scaled by ``time_scale``)
or, with ``rate``, as a seeded Poisson process; a session's turn k+1 starts only after turn k
finished plus its tool gap (scaled), and never before its own ``timestamp_s`` relative to the
session's start; a branch starts after its parent's fork turn finished plus ``gap_s``. A failed
turn ends its session (and the branches that fork after it). Because the prompt of every turn
is fixed by the trace (``agentserving.replay.trace``), every run sends identical tokens.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import blake3
import httpx
import numpy as np

from agentserving.core.hashing import DEFAULT_CHUNK_SIZE
from agentserving.core.openai_protocol import sse_data
from agentserving.core.schemas import PROMPT_SOURCES_PARAM
from agentserving.replay.ideal import ideal_hit
from agentserving.replay.metrics import summarize
from agentserving.replay.stats import reference_usage
from agentserving.replay.trace import ResolvedSession, ResolvedTurn, Trace, resolve_all

ROUTING_HEADER_PREFIX = "x-agentserving-"


@dataclass
class ReplayOptions:
    target: str
    model: str | None = None  # None: the first model of GET /v1/models, else "tiny"
    rate: float | None = None  # root sessions per second (Poisson); None: trace start times
    time_scale: float = 1.0
    # tool gaps only, on top of time_scale: a trace whose times were compressed at import
    # replays its tools as long as they ran, against a fleet slower than the trace's
    tool_gap_scale: float = 1.0
    seed: int = 0
    vocab_size: int | None = None  # None: the trace header's
    max_active_sessions: int | None = None
    request_timeout_s: float = 600.0
    chunk_size: int = DEFAULT_CHUNK_SIZE  # for the ideal hit rate
    progress: bool = True
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class TurnRecord:
    session_id: str
    turn: int
    parent_session_id: str | None
    last_turn: bool
    tool: str | None
    ok: bool = False
    status_code: int | None = None
    error: str | None = None
    start_s: float | None = None  # since the run started
    end_s: float | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    cached_reported: bool = False
    completion_tokens: int | None = None
    forced_tokens: int = 0
    forced_mismatch: bool = False
    appended_tokens: int = 0
    # the tool call the previous turn ended in ran this long (the trace's, time-scaled): 0
    # for a first turn or one that follows no tool
    gap_before_s: float = 0.0
    ideal_cached_tokens: int = 0
    source: str | None = None  # the session's meta.source
    pause: str | None = None  # the pause before the turn, as the trace calls it (meta.pause)
    # what the trace's provider billed for this turn (turn meta "usage"), where recorded
    reference_prompt_tokens: int | None = None
    reference_cached_tokens: int | None = None
    prefill_pod: str | None = None
    decode_pod: str | None = None
    routing: dict[str, str] = field(default_factory=dict)
    prompt_digest: str = ""
    output_digest: str = ""
    n_chunk_hashes: int | None = None
    chunk_hashes_digest: str | None = None
    # where the prompt's tokens came from and how long its loads took, as the pod that
    # prefilled it said (kv_transfer_params.prompt_sources; None from a pod that does not)
    prompt_sources: dict[str, Any] | None = None


@dataclass
class ReplayResult:
    records: list[TurnRecord]
    summary: dict[str, Any]
    out_dir: Path | None


def token_digest(tokens: list[int]) -> str:
    return blake3.blake3(np.asarray(tokens, dtype="<u4").tobytes()).hexdigest()[:32]


def _find_kv_params(obj: dict[str, Any]) -> dict[str, Any] | None:
    params = obj.get("kv_transfer_params")
    if isinstance(params, dict):
        return params
    for choice in obj.get("choices") or []:
        params = choice.get("kv_transfer_params") if isinstance(choice, dict) else None
        if isinstance(params, dict):
            return params
    return None


def _is_token_event(choice: dict[str, Any]) -> bool:
    return bool(choice.get("text") or choice.get("token_ids")
                or choice.get("finish_reason") is None)


class Replayer:
    """Replays a trace against a target; ``run()`` returns every turn's record and a summary."""

    def __init__(self, trace: Trace, options: ReplayOptions, *,
                 out_dir: str | Path | None = None,
                 on_record: Callable[[TurnRecord], None] | None = None) -> None:
        self.trace = trace
        self.opts = options
        self.sessions = resolve_all(trace, vocab_size=options.vocab_size)
        self.ideal = ideal_hit(self.sessions, chunk_size=options.chunk_size)
        self.out_dir = Path(out_dir) if out_dir else None
        self.on_record = on_record
        self.records: list[TurnRecord] = []
        self._children: dict[tuple[str, int], list[ResolvedSession]] = {}
        for rs in self.sessions:
            p = rs.session.parent
            if p is not None:
                self._children.setdefault((p.session_id, p.turn), []).append(rs)
        self._num_turns = {rs.session.session_id: len(rs.turns) for rs in self.sessions}
        self._t0 = 0.0
        self._model = options.model
        self._sem = (asyncio.Semaphore(options.max_active_sessions)
                     if options.max_active_sessions else None)
        self._progress: Any = None
        self._task_id: Any = None
        self._jsonl: Any = None

    # ---------------------------------------------------------------- schedule

    def arrivals(self) -> dict[str, float]:
        """Root session -> arrival offset (seconds after the run starts)."""
        roots = [rs.session for rs in self.sessions if rs.session.parent is None]
        out: dict[str, float] = {}
        if self.opts.rate:
            rng = random.Random(f"agentserving.replay/{self.opts.seed}/arrivals")
            t = 0.0
            for i, s in enumerate(roots):
                if i:
                    t += -math.log(1.0 - rng.random()) / self.opts.rate
                out[s.session_id] = t
        else:
            for s in roots:
                out[s.session_id] = (s.planned_start_s() or 0.0) * self.opts.time_scale
            if out:  # the trace's first arrival starts the run
                first = min(out.values())
                out = {k: v - first for k, v in out.items()}
        return out

    # ---------------------------------------------------------------- running

    def now(self) -> float:
        return time.perf_counter() - self._t0

    async def _sleep_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            await asyncio.sleep(delay)

    async def run(self) -> ReplayResult:
        timeout = httpx.Timeout(self.opts.request_timeout_s, connect=30.0)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        if self.out_dir:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(self.out_dir / "turns.jsonl", "w", encoding="utf-8")  # noqa: SIM115
        try:
            async with httpx.AsyncClient(base_url=self.opts.target.rstrip("/"), timeout=timeout,
                                         limits=limits, headers=self.opts.headers) as client:
                if self._model is None:
                    self._model = await self._discover_model(client)
                with self._progress_bar():
                    arrivals = self.arrivals()
                    self._t0 = time.perf_counter()
                    async with asyncio.TaskGroup() as tg:
                        self._tg = tg
                        for rs in self.sessions:
                            if rs.session.parent is None:
                                tg.create_task(self._session(client, rs,
                                                             arrivals[rs.session.session_id]))
        finally:
            if self._jsonl:
                self._jsonl.close()
        summary = self.summary()
        if self.out_dir:
            (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return ReplayResult(self.records, summary, self.out_dir)

    def summary(self) -> dict[str, Any]:
        summary = summarize([asdict(r) for r in self.records],
                            sessions_planned=len(self.sessions),
                            turns_planned=sum(len(rs.turns) for rs in self.sessions),
                            ideal_hit_rate=self.ideal.hit_rate)
        summary["replay"] = {
            "target": self.opts.target, "model": self._model, "rate": self.opts.rate,
            "time_scale": self.opts.time_scale, "tool_gap_scale": self.opts.tool_gap_scale,
            "seed": self.opts.seed,
            "chunk_size": self.opts.chunk_size, "source": self.trace.header.source,
            "max_active_sessions": self.opts.max_active_sessions,
        }
        return summary

    async def _discover_model(self, client: httpx.AsyncClient) -> str:
        try:
            r = await client.get("/v1/models", timeout=10.0)
            data = r.json().get("data") or []
            if r.is_success and data:
                return str(data[0]["id"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            pass
        return "tiny"

    async def _session(self, client: httpx.AsyncClient, rs: ResolvedSession,
                       start: float) -> None:
        await self._sleep_until(start)
        if self._sem is not None:
            async with self._sem:
                await self._turns(client, rs)
        else:
            await self._turns(client, rs)

    async def _turns(self, client: httpx.AsyncClient, rs: ResolvedSession) -> None:
        session = rs.session
        sid = session.session_id
        base = self.now()
        planned0 = session.planned_start_s()
        earliest = base
        for turn in rs.turns:
            if turn.timestamp_s is not None and planned0 is not None:
                earliest = max(earliest, base + (turn.timestamp_s - planned0) *
                               self.opts.time_scale)
            await self._sleep_until(earliest)
            record = await self._send(client, rs, turn)
            self._finish(record)
            if not record.ok:
                self._fail_children(sid, from_turn=turn.index)
                return
            for child in self._children.get((sid, turn.index), []):
                gap = child.session.parent.gap_s * self.opts.time_scale  # type: ignore[union-attr]
                self._tg.create_task(self._session(client, child, self.now() + gap))
            earliest = self.now() + turn.tool_gap_s * self._gap_scale

    @property
    def _gap_scale(self) -> float:
        """What a trace's tool gap is multiplied by."""
        return self.opts.time_scale * self.opts.tool_gap_scale

    def _fail_children(self, sid: str, from_turn: int) -> None:
        for (parent, turn), children in self._children.items():
            if parent == sid and turn >= from_turn:
                for child in children:
                    self._advance(len(child.turns))
                    self._fail_children(child.session.session_id, 0)

    def _finish(self, record: TurnRecord) -> None:
        self.records.append(record)
        if self._jsonl:
            self._jsonl.write(json.dumps(asdict(record), separators=(",", ":")) + "\n")
            self._jsonl.flush()
        if self.on_record:
            self.on_record(record)
        if not record.ok:  # the rest of its session is not sent
            remaining = self._remaining_turns(record)
            self._advance(1 + remaining)
        else:
            self._advance(1)

    def _remaining_turns(self, record: TurnRecord) -> int:
        return self._num_turns[record.session_id] - record.turn - 1

    # ---------------------------------------------------------------- one turn

    async def _send(self, client: httpx.AsyncClient, rs: ResolvedSession,
                    turn: ResolvedTurn) -> TurnRecord:
        session = rs.session
        source = session.meta.get("source")
        reference = reference_usage(session.turns[turn.index])
        rec = TurnRecord(
            session_id=session.session_id, turn=turn.index,
            parent_session_id=session.parent.session_id if session.parent else None,
            last_turn=turn.index == len(rs.turns) - 1, tool=turn.tool,
            forced_tokens=len(turn.forced_output), appended_tokens=turn.appended,
            gap_before_s=gap_before_s(rs.turns, turn.index) * self._gap_scale,
            ideal_cached_tokens=self.ideal.per_turn.get((turn.session_id, turn.index), 0),
            source=source if isinstance(source, str) else None,
            pause=pause if isinstance(pause := session.turns[turn.index].meta.get("pause"),
                                      str) else None,
            reference_prompt_tokens=reference[0] if reference else None,
            reference_cached_tokens=reference[1] if reference else None,
            prompt_digest=token_digest(turn.prompt),
            output_digest=token_digest(turn.forced_output))
        body = {
            "model": self._model, "prompt": turn.prompt, "max_tokens": len(turn.forced_output),
            "forced_output_token_ids": turn.forced_output, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        headers = {"x-session-id": session.session_id}
        if session.parent is not None:
            headers["x-parent-session-id"] = session.parent.session_id
        if turn.tool:
            headers["x-agentserving-next-tool"] = turn.tool
        sent = time.perf_counter()
        rec.start_s = sent - self._t0
        token_times: list[float] = []
        returned: list[int] | None = None  # output ids the server sent back, if any
        finished = done = False
        try:
            async with client.stream("POST", "/v1/completions", json=body,
                                     headers=headers) as resp:
                rec.status_code = resp.status_code
                rec.routing = {k.lower(): v for k, v in resp.headers.items()
                               if k.lower().startswith(ROUTING_HEADER_PREFIX)}
                rec.prefill_pod = rec.routing.get("x-agentserving-prefill-pod")
                rec.decode_pod = rec.routing.get("x-agentserving-decode-pod")
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    rec.error = f"HTTP {resp.status_code}: {_error_message(text)}"
                else:
                    async for line in resp.aiter_lines():
                        if (data := sse_data(line)) is None:
                            continue
                        if data == "[DONE]":
                            done = True
                            break
                        obj = json.loads(data)
                        if "error" in obj:
                            rec.error = f"stream error: {_error_message(json.dumps(obj))}"
                            break
                        now = time.perf_counter()
                        for choice in obj.get("choices") or []:
                            if _is_token_event(choice):
                                token_times.append(now)
                            if isinstance(choice.get("token_ids"), list):
                                returned = (returned or []) + choice["token_ids"]
                            if choice.get("finish_reason") is not None:
                                finished = True
                        usage = obj.get("usage")
                        if isinstance(usage, dict):
                            rec.prompt_tokens = usage.get("prompt_tokens")
                            rec.completion_tokens = usage.get("completion_tokens")
                            details = usage.get("prompt_tokens_details") or {}
                            if details.get("cached_tokens") is not None:
                                rec.cached_tokens = int(details["cached_tokens"])
                                rec.cached_reported = True
                        params = _find_kv_params(obj)
                        if params and isinstance(params.get(PROMPT_SOURCES_PARAM), dict):
                            rec.prompt_sources = params[PROMPT_SOURCES_PARAM]
                        if params and isinstance(params.get("chunk_hashes"), list):
                            hashes = [str(h) for h in params["chunk_hashes"]]
                            rec.n_chunk_hashes = len(hashes)
                            rec.chunk_hashes_digest = blake3.blake3(
                                "\n".join(hashes).encode()).hexdigest()[:32]
                    if rec.error is None and not (done or finished):
                        rec.error = "stream ended early"
        except httpx.TimeoutException as exc:
            rec.error = f"timeout: {type(exc).__name__}"
        except Exception as exc:  # noqa: BLE001 - any failure is this turn's error, recorded
            rec.error = f"{type(exc).__name__}: {exc}"[:300]
        end = time.perf_counter()
        rec.end_s = end - self._t0
        rec.e2e_s = end - sent
        if token_times:
            rec.ttft_s = token_times[0] - sent
            rec.itl_s = [b - a for a, b in zip(token_times, token_times[1:], strict=False)]
        rec.ok = rec.error is None
        if rec.ok:
            if rec.prompt_tokens is None:
                rec.prompt_tokens = len(turn.prompt)
            if rec.completion_tokens is None:
                rec.completion_tokens = len(token_times)
            if rec.cached_tokens is None:
                rec.cached_tokens = 0
            rec.forced_mismatch = (returned != turn.forced_output if returned is not None
                                   else rec.completion_tokens != len(turn.forced_output))
        return rec

    # ---------------------------------------------------------------- progress

    def _progress_bar(self) -> Any:
        import contextlib

        if not self.opts.progress:
            return contextlib.nullcontext()
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        total = sum(len(rs.turns) for rs in self.sessions)
        self._progress = Progress(TextColumn("replay"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("turns"), TimeElapsedColumn(),
                                  TextColumn("{task.fields[status]}"), transient=False)
        self._task_id = self._progress.add_task("replay", total=total, status="")
        return self._progress

    def _advance(self, n: int) -> None:
        if self._progress is not None:
            failed = sum(1 for r in self.records if not r.ok)
            self._progress.update(self._task_id, advance=n,
                                  status=f"[red]{failed} failed" if failed else "")


def _error_message(text: str) -> str:
    try:
        obj = json.loads(text)
        err = obj.get("error")
        if isinstance(err, dict):
            return str(err.get("message") or err)[:300]
        if err:
            return str(err)[:300]
    except ValueError:
        pass
    return text.strip()[:300]


def replay(trace: Trace, options: ReplayOptions, out_dir: str | Path | None = None
           ) -> ReplayResult:
    """Run a replay to completion (blocking)."""
    return asyncio.run(Replayer(trace, options, out_dir=out_dir).run())


def gap_before_s(turns: Sequence[ResolvedTurn], index: int) -> float:
    """The tool gap the turn at ``index`` follows: the previous turn's, when it called a tool."""
    prev = turns[index - 1] if index > 0 else None
    return prev.tool_gap_s if prev is not None and prev.tool else 0.0
