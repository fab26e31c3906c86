"""Repeated runs of the same configurations, summarised by their medians.

A figure from one run on a shared 2-core machine swings about 20 % from run to run, more than
many of the differences a comparison is after. ``agentserving compare --repeats N`` therefore
runs every configuration N times, interleaved (A B C, A B C, ...: a slow stretch of the
machine falls on every configuration alike), and reports each figure as the median of its N
values with their min and max; targets are judged on the medians, and the ratios of every
repeat are kept beside them, so "never worse in any repeat" can be read off too.

Pure: the replay's summaries in, report fields out.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from agentserving.replay.metrics import METRIC_KEYS, TABLE


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def median_of(runs: Sequence[Any]) -> Any:
    """The element-wise median of the same structure from several runs: numbers by their
    median (``None`` where a run has none: left out), objects key by key, anything else
    (names, lists of events) as the first run has it."""
    first = runs[0]
    if isinstance(first, Mapping):
        keys = list(dict.fromkeys(k for run in runs if isinstance(run, Mapping) for k in run))
        return {k: median_of([run.get(k) for run in runs if isinstance(run, Mapping)])
                for k in keys}
    numbers = [v for v in runs if _number(v)]
    if numbers and all(v is None or _number(v) for v in runs):
        median = statistics.median(numbers)
        if all(isinstance(v, int) for v in numbers) and median == int(median):
            return int(median)
        return round(float(median), 6)
    return first


# besides the table's figures: what failed, whose worst repeat matters more than its median
FAILURE_KEYS = ("turns_failed", "turns_not_sent", "forced_mismatches")


def spread(runs: Sequence[Mapping[str, Any]], keys: Sequence[str] = (*METRIC_KEYS, *FAILURE_KEYS)
           ) -> dict[str, dict[str, Any]]:
    """Each table figure's min and max over the runs (``None`` where no run has it)."""
    out: dict[str, dict[str, Any]] = {"min": {}, "max": {}}
    for key in keys:
        values = [r[key] for r in runs if _number(r.get(key))]
        out["min"][key] = min(values) if values else None
        out["max"][key] = max(values) if values else None
    return out


def combine(repeats: Sequence[Mapping[str, Mapping[str, Any]]]
            ) -> dict[str, dict[str, Any]]:
    """Per configuration: its median summary, with ``repeats`` holding ``n``, the figures'
    ``min`` / ``max`` and ``median_repeat`` (1-based: the repeat whose req/s is the median,
    the one whose turn records the plots draw)."""
    names = list(dict.fromkeys(name for rep in repeats for name in rep))
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        runs = [rep[name] for rep in repeats if name in rep]
        summary = median_of(runs)
        summary["repeats"] = {"n": len(runs), **spread(runs),
                              "median_repeat": median_repeat(runs)}
        out[name] = summary
    return out


def median_repeat(runs: Sequence[Mapping[str, Any]], key: str = "req_per_s") -> int:
    """1-based index of the run whose ``key`` is the (lower) median."""
    order = sorted(range(len(runs)), key=lambda i: (runs[i].get(key) is None,
                                                    runs[i].get(key) or 0.0))
    return order[(len(order) - 1) // 2] + 1


def ratio_spread(per_repeat: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """For each comparison, every ratio's values over the repeats, min and max: from the
    per-repeat reports' ``comparisons``."""
    out: dict[str, dict[str, Any]] = {}
    bases = list(dict.fromkeys(b for rep in per_repeat for b in rep.get("comparisons", {})))
    better = {k: b for k, _, b in TABLE}
    for base in bases:
        ratios = [rep["comparisons"][base]["ratios"] for rep in per_repeat
                  if base in rep.get("comparisons", {})]
        entry: dict[str, Any] = {}
        for key in METRIC_KEYS:
            values = [r.get(key) for r in ratios]
            known = [v for v in values if v is not None]
            if not known:
                continue
            # worst: the repeat least in the candidate's favour
            worst = min(known) if better[key] == "higher" else max(known)
            entry[key] = {"values": values, "min": min(known), "max": max(known),
                          "worst": worst}
        out[base] = entry
    return out
