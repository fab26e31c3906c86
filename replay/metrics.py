"""Run metrics from per-turn records: the columns of seed 003's evaluation table.

Definitions (all over one replay run):

- ``success_rate``: sessions (tasks) whose every turn completed, over all sessions planned. A
  session stops at its first failed turn; a branch whose parent failed before the fork fails too.
- ``turns_completed``: turns answered in full (a 200 and a complete stream).
- ``req_per_s``, ``tok_per_s``: completed turns, and their output tokens, per second of the
  run's makespan (first request sent to last response finished).
- ``prefix_hit_rate``: cached prompt tokens (``usage.prompt_tokens_details.cached_tokens``)
  over prompt tokens, summed over completed turns.
- ``ideal_hit_rate``: the same ratio for an unbounded cache, from the trace alone
  (``agentserving.replay.ideal``); ``hit_vs_ideal`` is their quotient.
- ``e2e_*_s``: request sent to last byte; ``ttft_*_s``: request sent to first token;
  ``itl_p99_s``: the 99th percentile of all gaps between consecutive tokens of all turns.
- ``ttft_p50_short_s``, ``ttft_p85_short_s`` over ``short_turns``: the turns whose uncached
  prompt (prompt tokens less the trace's ideal cached tokens, the same turns in every
  configuration) is under ``SHORT_TURN_TOKENS`` (seed 003's short requests: a tool result or a
  user message appended to a context already computed).
- ``ttft_p50_after_gap_s`` over ``after_gap_turns``: the turns that follow a tool call whose
  gap (the trace's, time-scaled) is over ``AFTER_GAP_S``: a session's KV idled through the
  tool, the turns the tool-gap prefetch is for. The bundled agent traces' tools run for tens
  of milliseconds (SWE-bench's shell commands), so every gap counts.
- ``ttft_p50_after_human_pause_s`` over ``after_human_pause_turns``: the turns the trace says
  follow a person's pause (``meta.pause`` ``human``: ``bundled:agent-pressure``), when a
  session's KV has had tens of seconds to leave DRAM; ``branch_start_ttft_p90_s`` over
  ``branch_starts``: the first turns of branches (forked subagents), which start from their
  parent's context wherever it is; ``mean_jct_s``: the mean over sessions whose every turn
  completed of their first turn's start to their last turn's end (pauses included).
- ``forced_mismatches``: completed turns whose output was not the forced one (by the returned
  token ids where the server sent them, else by their count).
- ``prompt_sources`` over ``sourced_turns``, the completed turns whose pod said where their
  prompt came from (``kv_transfer_params.prompt_sources``: vLLM pods with AgentServing's
  connector; not vLLM alone, nor the reference worker): prompt tokens by source (``device``,
  ``cpu``, ``disk``, ``remote``, ``computed``), summed; ``kv_load_s``, the time their loads
  held their steps, and ``disk_read_s``, the part of it spent reading the disk tier;
  ``fell_back_turns``, whose load failed and were recomputed.
- ``disk_read_critical_s`` over ``disk_read_turns``: the disk reads on the critical path of
  the turns after a tool call whose KV was on disk before they ran: at their announce (the
  proxy's ``x-agentserving-kv-at-announce`` header: some chunk on disk), or, for a turn not
  announced, when it ran (it read from disk). A prefetch that moved the KV to DRAM after the
  announce leaves the turn nothing to read. ``announced_turns`` and
  ``announced_on_disk_turns``: the turns announced during their tool call, and those whose
  KV was on disk then.
- ``by_source.<source>`` (turns whose session names a ``meta.source``): ``turns``,
  ``prefix_hit_rate``, ``ideal_hit_rate`` (the records' ``ideal_cached_tokens`` over their
  prompt tokens), ``hit_vs_ideal``, ``e2e_p50_s``, ``e2e_p95_s``; where the trace carries
  the provider's billed usage, ``reference_hit_rate`` (its cache-hit over prompt tokens on the
  same turns: what a production prefix cache served on the real, unscaled prompts) and
  ``ideal_vs_reference``, what the trace's scaling and whole-chunk caching leave of it.
Percentiles interpolate linearly (numpy's default); a metric with no samples is ``null``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

SHORT_TURN_TOKENS = 512
AFTER_GAP_S = 0.0

# The metrics of report.json's configs, in table order: (key, label, better).
TABLE: list[tuple[str, str, str]] = [
    ("success_rate", "task success", "higher"),
    ("turns_completed", "turns completed", "higher"),
    ("req_per_s", "request throughput (req/s)", "higher"),
    ("tok_per_s", "token throughput (tok/s)", "higher"),
    ("prefix_hit_rate", "prefix hit rate", "higher"),
    ("e2e_p50_s", "E2E P50 (s)", "lower"),
    ("e2e_p95_s", "E2E P95 (s)", "lower"),
    ("e2e_p99_s", "E2E P99 (s)", "lower"),
    ("ttft_p50_s", "TTFT P50 (s)", "lower"),
    ("ttft_p50_short_s", "short turns' TTFT P50 (s)", "lower"),
    ("ttft_p85_short_s", "short turns' TTFT P85 (s)", "lower"),
    ("ttft_p50_after_gap_s", "TTFT P50 after a tool gap (s)", "lower"),
    ("ttft_p95_s", "TTFT P95 (s)", "lower"),
    ("itl_p99_s", "ITL P99 (s)", "lower"),
]
METRIC_KEYS = [k for k, _, _ in TABLE]


def percentile(values: Sequence[float], q: float) -> float | None:
    if len(values) == 0:
        return None
    return float(np.percentile(np.asarray(values, dtype=float), q))


def summarize(records: Iterable[Mapping[str, Any]], *, sessions_planned: int,
              turns_planned: int, ideal_hit_rate: float | None = None) -> dict[str, Any]:
    """The metrics of one run (see the module docstring) from its turn records."""
    records = list(records)
    ok = [r for r in records if r.get("ok")]
    failed_sessions = {r["session_id"] for r in records if not r.get("ok")}
    completed_by_session: dict[str, int] = {}
    for r in ok:
        completed_by_session[r["session_id"]] = completed_by_session.get(r["session_id"], 0) + 1
    sessions_ok = sum(1 for r in records if r.get("ok") and r.get("last_turn")
                      and r["session_id"] not in failed_sessions)
    starts = [r["start_s"] for r in records if r.get("start_s") is not None]
    ends = [r["end_s"] for r in records if r.get("end_s") is not None]
    makespan = (max(ends) - min(starts)) if starts and ends else 0.0
    prompt = sum(int(r.get("prompt_tokens") or 0) for r in ok)
    cached = sum(int(r.get("cached_tokens") or 0) for r in ok)
    out_tokens = sum(int(r.get("completion_tokens") or 0) for r in ok)
    e2e = [r["e2e_s"] for r in ok if r.get("e2e_s") is not None]
    ttft = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
    itl = [x for r in ok for x in (r.get("itl_s") or [])]
    short = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None and is_short(r)]
    after_gap = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None
                 and float(r.get("gap_before_s") or 0.0) > AFTER_GAP_S]
    after_human = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None
                   and r.get("pause") == "human"]
    branch_starts = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None
                     and r.get("parent_session_id") and r.get("turn") == 0]
    hit = cached / prompt if prompt else None
    return {
        "success_rate": sessions_ok / sessions_planned if sessions_planned else None,
        "turns_completed": len(ok),
        "req_per_s": len(ok) / makespan if makespan > 0 else None,
        "tok_per_s": out_tokens / makespan if makespan > 0 else None,
        "prefix_hit_rate": hit,
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p95_s": percentile(e2e, 95),
        "e2e_p99_s": percentile(e2e, 99),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p95_s": percentile(ttft, 95),
        "itl_p99_s": percentile(itl, 99),
        "short_turns": len(short),
        "ttft_p50_short_s": percentile(short, 50),
        "ttft_p85_short_s": percentile(short, 85),
        "after_gap_turns": len(after_gap),
        "ttft_p50_after_gap_s": percentile(after_gap, 50),
        "after_human_pause_turns": len(after_human),
        "ttft_p50_after_human_pause_s": percentile(after_human, 50),
        "branch_starts": len(branch_starts),
        "branch_start_ttft_p90_s": percentile(branch_starts, 90),
        "mean_jct_s": mean_completion(records),
        "ideal_hit_rate": ideal_hit_rate,
        "hit_vs_ideal": (hit / ideal_hit_rate) if hit is not None and ideal_hit_rate else None,
        "sessions_planned": sessions_planned,
        "sessions_succeeded": sessions_ok,
        "turns_planned": turns_planned,
        "turns_failed": len(records) - len(ok),
        "turns_not_sent": turns_planned - len(records),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "output_tokens": out_tokens,
        "forced_mismatches": sum(1 for r in ok if r.get("forced_mismatch")),
        "makespan_s": makespan,
        "errors": _error_counts(records),
        "by_source": by_source(records),
        **prompt_sources(ok),
    }


def prompt_sources(ok: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Where the completed turns' prompt tokens came from, as their pods reported it, and the
    disk reads on the critical path of the turns a prefetch is for."""
    sourced = [r for r in ok if isinstance(r.get("prompt_sources"), dict)]
    tokens: dict[str, int] = {}
    for r in sourced:
        for source, n in (r["prompt_sources"].get("tokens") or {}).items():
            tokens[source] = tokens.get(source, 0) + int(n)
    announced = [r for r in ok if at_announce(r) is not None]
    on_disk = [r for r in sourced if kv_was_on_disk(r)]

    def total(recs: Sequence[Mapping[str, Any]], key: str) -> float | None:
        return sum(float(r["prompt_sources"].get(key) or 0.0) for r in recs) \
            if sourced else None

    return {
        "sourced_turns": len(sourced),
        "prompt_sources": tokens if sourced else None,
        "kv_load_s": total(sourced, "load_s"),
        "disk_read_s": total(sourced, "disk_read_s"),
        "fell_back_turns": sum(1 for r in sourced if r["prompt_sources"].get("fell_back")),
        "announced_turns": len(announced),
        "announced_on_disk_turns": sum(1 for r in announced if at_announce(r).get("disk")),
        "disk_read_turns": len(on_disk),
        "disk_read_critical_s": total(on_disk, "disk_read_s"),
    }


def at_announce(record: Mapping[str, Any]) -> dict[str, int] | None:
    """Where the pods found the turn's KV when it was announced (the proxy's header), None
    when it was not announced."""
    from agentserving.proxy.tool_gaps import H_AT_ANNOUNCE, parse_at_announce

    raw = (record.get("routing") or {}).get(H_AT_ANNOUNCE)
    return None if raw is None else parse_at_announce(raw)


def kv_was_on_disk(record: Mapping[str, Any]) -> bool:
    """A turn after a tool call whose KV was on disk before it ran: at its announce, or, not
    announced, when it ran."""
    if float(record.get("gap_before_s") or 0.0) <= 0:
        return False
    announced = at_announce(record)
    if announced is not None:
        return announced.get("disk", 0) > 0
    tokens = (record.get("prompt_sources") or {}).get("tokens") or {}
    return int(tokens.get("disk", 0)) > 0


def mean_completion(records: list[Mapping[str, Any]]) -> float | None:
    """Mean over sessions whose every sent turn completed, through their last turn, of first
    turn's start to last turn's end."""
    spans: dict[str, list[float]] = {}
    done, failed = set(), set()
    for r in records:
        if not r.get("ok") or r.get("start_s") is None or r.get("end_s") is None:
            failed.add(r["session_id"])
            continue
        span = spans.setdefault(r["session_id"], [r["start_s"], r["end_s"]])
        span[0], span[1] = min(span[0], r["start_s"]), max(span[1], r["end_s"])
        if r.get("last_turn"):
            done.add(r["session_id"])
    times = [end - start for sid, (start, end) in spans.items() if sid in done - failed]
    return float(np.mean(times)) if times else None


def is_short(record: Mapping[str, Any]) -> bool:
    """A turn whose uncached prompt, by the trace's ideal cache, is under SHORT_TURN_TOKENS."""
    prompt = record.get("prompt_tokens")
    if prompt is None:
        return False
    return int(prompt) - int(record.get("ideal_cached_tokens") or 0) < SHORT_TURN_TOKENS


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def by_source(records: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The per-source block of the summary (see the module docstring), over completed turns."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for r in records:
        if r.get("ok") and isinstance(r.get("source"), str):
            groups.setdefault(r["source"], []).append(r)
    out: dict[str, dict[str, Any]] = {}
    for source, recs in sorted(groups.items()):
        prompt = sum(int(r.get("prompt_tokens") or 0) for r in recs)
        hit = _ratio(sum(int(r.get("cached_tokens") or 0) for r in recs), prompt)
        ideal = _ratio(sum(int(r.get("ideal_cached_tokens") or 0) for r in recs), prompt)
        e2e = [r["e2e_s"] for r in recs if r.get("e2e_s") is not None]
        entry: dict[str, Any] = {
            "turns": len(recs), "prefix_hit_rate": hit, "ideal_hit_rate": ideal,
            "hit_vs_ideal": hit / ideal if hit is not None and ideal else None,
            "e2e_p50_s": percentile(e2e, 50), "e2e_p95_s": percentile(e2e, 95)}
        refs = [r for r in recs if r.get("reference_prompt_tokens")]
        if refs:
            reference = _ratio(sum(int(r.get("reference_cached_tokens") or 0) for r in refs),
                               sum(int(r["reference_prompt_tokens"]) for r in refs))
            ideal_there = _ratio(sum(int(r.get("ideal_cached_tokens") or 0) for r in refs),
                                 sum(int(r.get("prompt_tokens") or 0) for r in refs))
            entry["reference_hit_rate"] = reference
            entry["ideal_vs_reference"] = ideal_there / reference \
                if ideal_there is not None and reference else None
        out[source] = entry
    return out


def _error_counts(records: list[Mapping[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in records:
        if not r.get("ok"):
            key = str(r.get("error") or "unknown")[:120]
            counts[key] = counts.get(key, 0) + 1
    return counts


def ratios(baseline: Mapping[str, Any], candidate: Mapping[str, Any]) -> dict[str, float | None]:
    """candidate / baseline for every table metric (``null`` where undefined)."""
    out: dict[str, float | None] = {}
    for key in METRIC_KEYS:
        b, c = baseline.get(key), candidate.get(key)
        out[key] = (c / b) if isinstance(b, int | float) and isinstance(c, int | float) and b \
            else None
    return out
