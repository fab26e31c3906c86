"""Pure prefill scheduling policies (state in, decision out, no I/O).

``build_policy(name, **options)`` makes one by name; the same objects serve the reference
engine (``agentserving.engine.scheduler.prefill_policies``), the cluster simulator and the
vLLM plugin (``agentserving.prefill.vllm_plugin``). See docs/scheduling.md.
"""

from __future__ import annotations

from typing import Any

from agentserving.prefill.policies.base import PurePolicy, is_safe, max_advance
from agentserving.prefill.policies.fcfs import FcfsChunk, FcfsNoChunk
from agentserving.prefill.policies.longcap import LongcapDynamic
from agentserving.prefill.policies.types import Decision, ReqView, SchedState, advance

POLICY_CLASSES: dict[str, type] = {
    "fcfs-nochunk": FcfsNoChunk,
    "fcfs-chunk": FcfsChunk,
    "longcap-dynamic": LongcapDynamic,
}
# what a --scheduler-policy may name besides the engine's own scheduler: the pure policies, and
# ``shadow`` (longcap-dynamic under the ShadowScheduler)
SCHEDULER_POLICY_NAMES = (*POLICY_CLASSES, "shadow")
# the options of the policies that take fractions (how a NAME?opt=value spec parses them)
FLOAT_OPTIONS = frozenset({"long_cap", "context_cost", "split_overhead", "attention_cost",
                           "step_cost", "long_max_wait_s"})


def build_policy(name: str, **options: Any) -> PurePolicy:
    try:
        cls = POLICY_CLASSES[name]
    except KeyError:
        known = sorted(POLICY_CLASSES)
        raise ValueError(f"unknown prefill policy {name!r}; known: {known}") from None
    return cls(**options)


__all__ = ["FLOAT_OPTIONS", "POLICY_CLASSES", "SCHEDULER_POLICY_NAMES", "Decision", "FcfsChunk",
           "FcfsNoChunk", "LongcapDynamic", "PurePolicy", "ReqView", "SchedState", "advance",
           "build_policy", "is_safe", "max_advance"]
