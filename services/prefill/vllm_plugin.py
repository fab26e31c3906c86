"""vLLM-facing glue for the pure prefill policies (a ``--scheduler-cls`` plugin) — a sketch.

What exists and was exercised here: ``views_from_vllm`` turns duck-typed vLLM ``Request``
objects (``request_id``, ``arrival_time``, ``num_prompt_tokens``, ``num_computed_tokens``,
``num_cached_tokens``) into ``ReqView``s and ``budgets`` turns a ``Decision`` into the
per-request token budgets a vLLM scheduler step would hand out; both are plain Python and
are only exercised through the unit tests of the pure policies (the same ``ReqView`` /
``Decision`` objects).

What was NOT exercised: vLLM itself cannot run on these machines (its C extension needs
libcuda) and is not installed. The scheduler subclass (``vllm.v1.core.sched.scheduler.
Scheduler`` overriding ``schedule()`` to consult the policy before filling
``num_scheduled_tokens``) is not written yet; nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from agentserving.prefill.policies.types import Decision, ReqView


def views_from_vllm(waiting: Iterable[Any], running: Iterable[Any]) -> tuple[
        tuple[ReqView, ...], tuple[ReqView, ...]]:
    def view(r: Any, is_running: bool) -> ReqView:
        computed = r.num_computed_tokens if is_running else max(
            0, getattr(r, "num_cached_tokens", 0) or 0)
        return ReqView(r.request_id, float(r.arrival_time), int(r.num_prompt_tokens),
                       computed=int(computed), running=is_running)

    return (tuple(view(r, False) for r in waiting), tuple(view(r, True) for r in running))


def budgets(decision: Decision) -> dict[str, int]:
    """request_id -> prompt tokens to schedule this step (vLLM's ``num_scheduled_tokens``)."""
    out = dict(decision.prefill)
    for rid in decision.decode:
        out[rid] = out.get(rid, 0) + 1
    return out
