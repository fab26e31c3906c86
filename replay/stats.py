"""The shape of a trace: sessions, turns, tokens, tool gaps, and its ideal hit rate."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from agentserving.core.hashing import DEFAULT_CHUNK_SIZE
from agentserving.replay.ideal import ideal_hit
from agentserving.replay.trace import Trace, resolve_all


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
    }
