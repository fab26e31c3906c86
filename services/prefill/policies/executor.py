"""How the engine executes a prefill pass, in one place: the engine (engine/core.py) runs by
it, the pure policies plan by it, and the cluster simulator and the scheduling bench model it.

Two rules. A pass's token budget is rounded down to whole KV chunks (at least one), so chunk
boundaries fall on LMCache's grid. And the prompt's trailing partial chunk is a pass of its
own: the full chunks are computed (and stored) first, the partial chunk, which no tier keeps,
after them.
"""

from __future__ import annotations


def pass_limit(start: int, total: int, quantum: int, split_tail: bool = True) -> int:
    """The furthest one pass from ``start`` may reach in a ``total``-token prompt: the end of
    its full ``quantum``-token chunks while any is left (with ``split_tail``), else its end."""
    if split_tail and quantum > 1:
        full_end = total - total % quantum
        if start < full_end:
            return full_end
    return total


def pass_end(start: int, total: int, budget: int, chunk: int) -> int:
    """Where the engine's next pass over a prompt ends, given the step's token ``budget``."""
    budget = max(chunk, budget - budget % chunk)
    return min(start + budget, pass_limit(start, total, chunk))
