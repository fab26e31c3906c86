"""One prefill pod's arrivals: agent turns as (new tokens over a cached context), drawn from a
seed-like mix of chat, RAG, SWE-agent and long-document turns, with Poisson arrival times.

The scheduling study (``bench/prefill_sched_bench.py``, docs/scheduling.md) replays them on one
prefill pod (``sim.prefill_pod``); the cluster simulator's sessions are ``sim.workload``'s.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import numpy as np

from agentserving.core.hashing import DEFAULT_CHUNK_SIZE

CHUNK = DEFAULT_CHUNK_SIZE


def pct(xs: list[float], q: float) -> float:
    """The ``q``-th percentile of ``xs`` (NaN for none, which the JSON keeps as NaN)."""
    return float(np.percentile(np.asarray(xs, dtype=float), q)) if xs else float("nan")


@dataclasses.dataclass
class Turn:
    rid: str
    arrival: float
    prompt: int
    cached: int
    on_disk: bool
    kind: str = ""


# Seed 003's evaluation set (section 10): 1,999 trajectories = LMSYS-Chat 600 + WildChat 600 +
# MTRAG 300 + SWE-bench 300 + LongBench 200, 12,740 turns in all (section 5). Turns per
# trajectory are assumed (not in the seed): chat 2.5, MTRAG 7.5, LongBench 1 (single-shot
# long documents), SWE-bench the rest, (12740 - 1200*2.5 - 300*7.5 - 200) / 300 ~ 24. The token
# shapes per turn are assumptions too (see docs/scheduling.md): (share of turns, sampler).
def _chat(rng: random.Random) -> tuple[int, int]:
    # user message + the previous reply (not cached on a P/D prefill pod) over a short history
    return _clip(rng.lognormvariate(5.9, 0.8), 16, 4096), rng.randint(0, 16) * CHUNK


def _rag(rng: random.Random) -> tuple[int, int]:
    # question + retrieved passages (a few ~200-token passages) over the conversation so far
    return _clip(rng.lognormvariate(6.7, 0.5), 128, 8192), rng.randint(4, 48) * CHUNK


def _swe(rng: random.Random) -> tuple[int, int]:
    if rng.random() < 1 / 24:  # first turn: tools + issue text over a shared system prompt
        return rng.randint(12, 32) * CHUNK, 8 * CHUNK
    # a tool result (file views, test logs: heavy tail) over a growing context
    return _clip(rng.lognormvariate(6.2, 1.0), 32, 16384), rng.randint(16, 160) * CHUNK


def _longdoc(rng: random.Random) -> tuple[int, int]:
    # LongBench: one long document + question, nothing cached
    return rng.randint(32, 128) * CHUNK, 0


TURN_MIX: dict[str, tuple[float, Any]] = {
    "chat": (3000 / 12740, _chat), "rag": (2250 / 12740, _rag),
    "swe": (7290 / 12740, _swe), "longdoc": (200 / 12740, _longdoc)}


def _clip(x: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, x)))


def make_trace(n: int, rate: float, seed: int) -> list[Turn]:
    """Poisson arrivals of agent turns drawn from the seed-like ``TURN_MIX``: many short turns
    appending a few hundred tokens to a cached context, a few very long prefills (first SWE
    turns, big tool outputs, long documents) that block everything behind them under fcfs."""
    rng = random.Random(seed)
    kinds = list(TURN_MIX)
    weights = [TURN_MIX[k][0] for k in kinds]
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        kind = rng.choices(kinds, weights)[0]
        new, cached = TURN_MIX[kind][1](rng)
        out.append(Turn(f"t{i}", t, cached + new, cached, rng.random() < 0.5, kind))
    return out


def trace_summary(trace: list[Turn], short_tokens: int) -> dict[str, Any]:
    new = np.array([x.prompt - x.cached for x in trace])
    return {"turns_by_kind": {k: sum(x.kind == k for x in trace) for k in TURN_MIX},
            "new_tokens": {"p50": pct(list(new), 50), "p90": pct(list(new), 90),
                           "p99": pct(list(new), 99), "max": int(new.max())},
            "cached_tokens_p50": pct([x.cached for x in trace], 50),
            "long_share": float(np.mean(new > short_tokens)),
            "short_tokens": short_tokens}
