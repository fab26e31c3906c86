"""A profile's step prices against the steps a real engine took (``--step-log-dir``).

The validation fits how busy a run's host was; this checks the other half of the model, what
each step costs on its own: for every logged step, the profile's price of that step's shape
(``a`` + each prefill chunk at its start + the decodes over their context, as the simulator's
``_engine_step`` prices it) against the step loop thread's CPU seconds, and the step's wall
seconds against its CPU seconds (how much the host's sharing stretched it).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from agentserving.sim.profile import Profile


def load_step_logs(folder: Path) -> dict[str, list[dict[str, Any]]]:
    """Each engine's steps, by file stem (``POD-K``)."""
    return {f.stem: [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
            for f in sorted(Path(folder).glob("*.jsonl"))}


def step_price(profile: Profile, step: dict[str, Any]) -> float:
    chunks = step.get("chunks") or ()
    price = profile.prefill.a_s if chunks else 0.0
    price += sum(profile.chunk_s(n, start) for start, n in chunks)
    if step.get("decode_tokens"):
        price += profile.decode_s(step["decode_tokens"], step.get("decode_context", 0))
    return price


def price_steps(profile: Profile, steps: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Per step kind (``decode`` only, or with a ``prefill`` chunk): steps, the profile's
    price, the loop's CPU and wall seconds, and their ratios."""
    out: dict[str, dict[str, float]] = {}
    for s in steps:
        kind = "prefill" if s.get("chunks") else "decode"
        row = out.setdefault(kind, {"steps": 0, "price_s": 0.0, "cpu_s": 0.0, "wall_s": 0.0})
        row["steps"] += 1
        row["price_s"] += step_price(profile, s)
        row["cpu_s"] += s["cpu_s"]
        row["wall_s"] += s["forward_s"] + s.get("exposed_kv_s", 0.0)
    for row in out.values():
        row["cpu_over_price"] = row["cpu_s"] / row["price_s"] if row["price_s"] else None
        row["wall_over_cpu"] = row["wall_s"] / row["cpu_s"] if row["cpu_s"] else None
    return out


def role_factors(profile: Profile, logs: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    """Per pod role, the loop's CPU seconds over the profile's price of all its steps: the
    ``Profile.step_cost_factor`` that makes the simulated steps cost what the real ones did."""
    by_role: dict[str, list[dict[str, Any]]] = {}
    for steps in logs.values():
        for s in steps:
            if "role" in s:
                by_role.setdefault(s["role"], []).append(s)
    out = {}
    for role, steps in sorted(by_role.items()):
        price = sum(step_price(profile, s) for s in steps)
        if price > 0:
            out[role] = round(sum(s["cpu_s"] for s in steps) / price, 3)
    return out
