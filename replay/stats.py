"""The shape of a trace: sessions, turns, tokens, tool gaps, and its ideal hit rate; per
source (sessions' ``meta.source``) too, with the reference hit rate where turns carry the
provider's billed usage (``meta.usage``: what its production prefix cache served)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from agentserving.core.hashing import DEFAULT_CHUNK_SIZE
from agentserving.replay.ideal import IdealResult, ideal_hit
from agentserving.replay.trace import ResolvedSession, Trace, Turn, resolve_all


def _dist(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    a = np.asarray(values, dtype=float)
    return {"mean": round(float(a.mean()), 3), "p50": round(float(np.percentile(a, 50)), 3),
            "p90": round(float(np.percentile(a, 90)), 3), "max": round(float(a.max()), 3)}


def trace_stats(trace: Trace, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> dict[str, Any]:
    sessions = resolve_all(trace)
    turns = [t for rs in sessions for t in rs.turns]
    ideal = ideal_hit(sessions, chunk_size=chunk_size)
    return {
        "source": trace.header.source,
        "sessions": len(sessions),
        "branches": sum(1 for rs in sessions if rs.session.parent is not None),
        "turns": len(turns),
        "turns_per_session": _dist([len(rs.turns) for rs in sessions]),
        "prompt_tokens": _dist([len(t.prompt) for t in turns]),
        "appended_tokens": _dist([t.appended for t in turns]),
        "output_tokens": _dist([len(t.forced_output) for t in turns]),
        "tool_gap_s": _dist([t.tool_gap_s for t in turns if t.tool]),
        "tools": dict(Counter(t.tool for t in turns if t.tool).most_common()),
        "total_prompt_tokens": ideal.prompt_tokens,
        "total_output_tokens": sum(len(t.forced_output) for t in turns),
        "ideal_hit_rate": round(ideal.hit_rate, 4),
        "ideal_uncached_prompt_tokens": ideal.prompt_tokens - ideal.reusable_tokens,
        "chunk_size": chunk_size,
        "by_source": by_source(sessions, ideal),
    }


def reference_usage(turn: Turn) -> tuple[int, int] | None:
    """(prompt tokens, cache-hit tokens) the provider billed for this turn, if recorded."""
    usage = turn.meta.get("usage")
    if not isinstance(usage, dict) or "prompt_tokens" not in usage:
        return None
    return int(usage["prompt_tokens"]), int(usage.get("prompt_cache_hit_tokens") or 0)


def by_source(sessions: list[ResolvedSession], ideal: IdealResult) -> dict[str, Any]:
    """Per ``meta.source``: sessions, turns, prompt tokens, ideal hit rate (of the whole
    trace's unbounded cache, so sharing across sources counts), and the reference hit rate
    over the turns that carry the provider's usage."""
    groups: dict[str, list[ResolvedSession]] = {}
    for rs in sessions:
        source = rs.session.meta.get("source")
        if isinstance(source, str):
            groups.setdefault(source, []).append(rs)
    out: dict[str, Any] = {}
    for source, group in sorted(groups.items()):
        turns = [t for rs in group for t in rs.turns]
        prompt = sum(len(t.prompt) for t in turns)
        reused = sum(ideal.per_turn.get((t.session_id, t.index), 0) for t in turns)
        refs = [u for rs in group for t in rs.session.turns
                if (u := reference_usage(t)) is not None]
        entry: dict[str, Any] = {
            "sessions": len(group), "turns": len(turns), "prompt_tokens": prompt,
            "output_tokens": sum(len(t.forced_output) for t in turns),
            "ideal_hit_rate": round(reused / prompt, 4) if prompt else None}
        if refs:
            ref_prompt = sum(p for p, _ in refs)
            entry["reference_hit_rate"] = round(sum(h for _, h in refs) / ref_prompt, 4) \
                if ref_prompt else None
            entry["reference_turns"] = len(refs)
        out[source] = entry
    return out
