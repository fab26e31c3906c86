"""Tool-call gap prediction (seed 003's tool-call time predictor), online and per tool.

When a turn ends in a tool call, the next turn of that session arrives after the tool runs.
The predictor keeps, per tool name, an exponentially weighted mean of observed gaps (falling
back to the mean over all tools, then to a default), so the proxy can prefetch the session's
chunks into DRAM shortly before the next turn arrives.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass
class _Ewma:
    value: float
    count: int = 1


class ToolGapPredictor:
    """``max_tools`` bounds the per-tool table: tool names come from callers and models, so
    past it a new name is predicted (and learnt) by the overall mean only."""

    def __init__(self, alpha: float = 0.3, default_gap_s: float = 2.0, max_tools: int = 512
                 ) -> None:
        self.alpha = alpha
        self.default_gap_s = default_gap_s
        self.max_tools = max_tools
        self._per_tool: dict[str, _Ewma] = {}
        self._overall: _Ewma | None = None

    def predict(self, tool: str | None) -> float:
        if tool is not None and tool in self._per_tool:
            return self._per_tool[tool].value
        if self._overall is not None:
            return self._overall.value
        return self.default_gap_s

    def observe(self, tool: str | None, gap_s: float) -> None:
        gap_s = max(0.0, gap_s)
        if tool is not None and (tool in self._per_tool or len(self._per_tool) < self.max_tools):
            self._per_tool[tool] = self._update(self._per_tool.get(tool), gap_s)
        self._overall = self._update(self._overall, gap_s)

    def _update(self, old: _Ewma | None, gap_s: float) -> _Ewma:
        if old is None:
            return _Ewma(gap_s)
        return _Ewma(old.value + self.alpha * (gap_s - old.value), old.count + 1)

    def prefetch_delay(self, tool: str | None, lead_s: float) -> float:
        """Seconds after a turn ends to start prefetching for the next one."""
        return max(0.0, self.predict(tool) - lead_s)


def pin_ttl_for_gap(predicted_gap_s: float, floor_s: float, cap_s: float,
                    multiple: float) -> float:
    """A pin's TTL when the caller gave none: ``multiple`` times the predicted tool gap (a
    prediction is a mean, and a pin that lapses a moment before the turn returns saves
    nothing), never under ``floor_s`` (a first gap is predicted from the default alone) nor over
    ``cap_s`` (a pin holds memory other sessions could use)."""
    return min(cap_s, max(floor_s, predicted_gap_s * multiple))


def prefetch_found(results: Mapping[str, Any]) -> dict[str, int]:
    """Where the pods found a tool-gap prefetch's chunks, from the kvindex's fan-out answer
    (pod -> its memory API's reply): a session whose chunks were on disk is the one the
    prefetch is for; all in DRAM, it had nothing to move. A pod whose scheduler took the
    announce for later says where its book puts the chunks now; one that says nothing of
    them counts as ``scheduled``. ``held``: of those chunks, the ones the pods pinned until
    the turn is due (the announce's ``hold_s``), counted besides where they were."""
    found = {"dram": 0, "disk": 0, "missing": 0, "scheduled": 0, "held": 0}
    for result in results.values():
        reply = getattr(result, "response", None) or {}
        found["held"] += int(reply.get("num_held") or 0)
        placed = sum(int(reply.get(k) or 0) for k in ("num_in_cpu", "num_to_load",
                                                       "num_missing"))
        if reply.get("status") == "prefetch_scheduled" and not placed:
            found["scheduled"] += int(reply.get("num_chunks") or 0)
            continue
        found["dram"] += int(reply.get("num_in_cpu") or 0)
        found["disk"] += int(reply.get("num_to_load") or 0)
        found["missing"] += int(reply.get("num_missing") or 0)
    return found


# where the pods found the session's KV when this turn was announced, during the tool call
# before it ("dram=12,disk=30"); absent when it was not announced
H_AT_ANNOUNCE = "x-agentserving-kv-at-announce"


def parse_at_announce(value: str) -> dict[str, int]:
    """``at_announce_header``'s counts back ("none": {})."""
    out = {}
    for part in value.split(","):
        key, sep, n = part.partition("=")
        if sep and n.isdigit():
            out[key.strip()] = int(n)
    return out


def at_announce_header(found: Mapping[str, int]) -> str:
    """``x-agentserving-kv-at-announce``: where the session's KV was when its turn was
    announced (``prefetch_found``'s counts, those that are not 0)."""
    return ",".join(f"{k}={n}" for k, n in found.items() if n) or "none"
