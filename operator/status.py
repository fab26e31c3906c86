"""Pure status computation: the children's observed state in, the resource's status out.

Readiness is what the workloads' controllers report (ready replicas of each StatefulSet and
Deployment), never what was merely asked for: pods that stay Pending keep the resource not
Ready. The conditions follow Kubernetes conventions: ``Ready``, ``Progressing`` and
``Degraded``, each with a CamelCase reason and a human message; a condition's
lastTransitionTime changes only when its status does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Phases, in the order a healthy resource goes through them.
PENDING, PROGRESSING, READY, DEGRADED = "Pending", "Progressing", "Ready", "Degraded"


@dataclass(frozen=True)
class Failure:
    """Why the last reconcile could not bring the children to the spec."""

    reason: str  # e.g. InvalidSpec, ReconcileFailed
    message: str


def component_status(workload: dict[str, Any] | None, selector: str = "") -> dict[str, Any]:
    """One workload's replica counts; a workload that does not exist yet counts as 0 ready."""
    spec = (workload or {}).get("spec") or {}
    status = (workload or {}).get("status") or {}
    desired = int(spec.get("replicas", 0) or 0)
    ready = int(status.get("readyReplicas", 0) or 0)
    out = {
        "replicas": desired,
        "readyReplicas": ready,
        "updatedReplicas": int(status.get("updatedReplicas", 0) or 0),
        "ready": f"{ready}/{desired}",
    }
    if selector:
        out["selector"] = selector
    return out


def _rolled_out(workload: dict[str, Any] | None) -> bool:
    """The workload's controller has seen its latest spec and replaced every pod."""
    if workload is None:
        return False
    generation = workload.get("metadata", {}).get("generation", 0)
    status = workload.get("status") or {}
    desired = int((workload.get("spec") or {}).get("replicas", 0) or 0)
    return (int(status.get("observedGeneration", 0) or 0) >= generation
            and int(status.get("updatedReplicas", 0) or 0) >= desired)


def _condition(ctype: str, ok: bool, reason: str, message: str, generation: int,
               previous: dict[str, dict[str, Any]], now: str) -> dict[str, Any]:
    status = "True" if ok else "False"
    prev = previous.get(ctype)
    since = prev["lastTransitionTime"] if prev and prev.get("status") == status and prev.get(
        "lastTransitionTime") else now
    return {"type": ctype, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": since, "observedGeneration": generation}


def compute_status(
    *,
    workloads: dict[str, dict[str, Any] | None],
    selectors: dict[str, str],
    observed_generation: int,
    generation: int,
    endpoint: str,
    previous: dict[str, Any] | None,
    now: str,
    failure: Failure | None = None,
) -> dict[str, Any]:
    """The resource's status.

    workloads: component -> its StatefulSet/Deployment as last read (None: not created yet).
    selectors: component -> label selector string (the decode one backs the scale subresource).
    observed_generation: the resource generation the children were last applied from.
    generation: the resource's current metadata.generation.
    """
    components = {c: component_status(w, selectors.get(c, "")) for c, w in workloads.items()}
    not_ready = [c for c, s in components.items() if s["readyReplicas"] < s["replicas"]]
    rolling = [c for c, w in workloads.items() if not _rolled_out(w)]
    summary = ", ".join(f"{c} {s['ready']}" for c, s in components.items()) or "no workloads"
    stale = observed_generation < generation
    any_ready = any(s["readyReplicas"] > 0 for s in components.values())
    nothing_wanted = all(s["replicas"] == 0 for s in components.values())

    prev_conditions = {c["type"]: c for c in (previous or {}).get("conditions") or []}
    g = observed_generation
    if failure is not None:
        phase = DEGRADED
        ready = _condition("Ready", False, failure.reason, failure.message, g, prev_conditions, now)
        degraded = _condition("Degraded", True, failure.reason, failure.message, g,
                              prev_conditions, now)
    else:
        degraded = _condition("Degraded", False, "AsExpected", "children match the spec", g,
                              prev_conditions, now)
        if not not_ready and not stale:
            phase = READY
            ready = _condition("Ready", True, "AllComponentsReady", summary, g, prev_conditions,
                               now)
        else:
            phase = PROGRESSING if any_ready or nothing_wanted else PENDING
            ready = _condition("Ready", False, "ComponentsNotReady",
                               f"waiting for {', '.join(not_ready) or 'reconcile'}: {summary}",
                               g, prev_conditions, now)
    if failure is not None:
        progressing = _condition("Progressing", False, failure.reason,
                                 "reconcile stopped until the spec or the cluster changes", g,
                                 prev_conditions, now)
    elif stale:
        progressing = _condition("Progressing", True, "NewGeneration",
                                 f"generation {generation} not applied yet", g, prev_conditions,
                                 now)
    elif rolling:
        progressing = _condition("Progressing", True, "RollingOut",
                                 f"rolling out {', '.join(rolling)}", g, prev_conditions, now)
    elif not_ready:
        progressing = _condition("Progressing", True, "WaitingForReplicas",
                                 f"waiting for ready replicas: {summary}", g, prev_conditions, now)
    else:
        progressing = _condition("Progressing", False, "RolloutComplete", summary, g,
                                 prev_conditions, now)
    return {
        "phase": phase,
        "observedGeneration": observed_generation,
        "endpoint": endpoint,
        **components,
        "conditions": [ready, progressing, degraded],
    }


def same_status(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Equal apart from timestamps: no need to write b over a."""
    def strip(s: dict[str, Any] | None) -> dict[str, Any]:
        s = dict(s or {})
        s["conditions"] = [{k: v for k, v in c.items() if k != "lastTransitionTime"}
                           for c in s.get("conditions") or []]
        return s
    return strip(a) == strip(b)
