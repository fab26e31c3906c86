from __future__ import annotations

from agentserving.operator.status import (
    DEGRADED,
    PENDING,
    PROGRESSING,
    READY,
    Failure,
    compute_status,
    same_status,
)

T0, T1 = "2025-01-01T00:00:00Z", "2025-01-01T00:05:00Z"


def workload(replicas, ready, generation=1, observed=1, updated=None):
    return {"metadata": {"generation": generation}, "spec": {"replicas": replicas},
            "status": {"readyReplicas": ready, "observedGeneration": observed,
                       "updatedReplicas": replicas if updated is None else updated}}


def status_of(workloads, *, observed=3, generation=3, previous=None, now=T0, failure=None):
    return compute_status(workloads=workloads, selectors={"decode": "a=b"},
                          observed_generation=observed, generation=generation,
                          endpoint="http://x-proxy.ns.svc:8080/v1", previous=previous, now=now,
                          failure=failure)


def cond(status, ctype):
    return next(c for c in status["conditions"] if c["type"] == ctype)


def state(s: dict, kind: str) -> tuple[str, str]:
    """(status, reason) of the condition ``kind``."""
    c = cond(s, kind)
    return c["status"], c["reason"]


def all_pending():
    # Pods that stay Pending (no kubelet, no node) never become ready.
    return {"prefill": workload(1, 0), "decode": workload(2, 0), "proxy": workload(1, 0),
            "kvindex": workload(1, 0)}


def test_pending_pods_are_reported_honestly():
    s = status_of(all_pending())
    assert s["phase"] == PENDING
    assert state(s, "Ready") == ("False", "ComponentsNotReady")
    assert "decode 0/2" in cond(s, "Ready")["message"]
    assert state(s, "Progressing") == ("True", "WaitingForReplicas")
    assert cond(s, "Degraded")["status"] == "False"
    assert s["decode"] == {"replicas": 2, "readyReplicas": 0, "updatedReplicas": 2,
                           "ready": "0/2", "selector": "a=b"}
    assert s["observedGeneration"] == 3
    assert s["endpoint"] == "http://x-proxy.ns.svc:8080/v1"


def test_all_ready_is_ready():
    w = {"prefill": workload(1, 1), "decode": workload(2, 2), "proxy": workload(1, 1),
         "kvindex": workload(1, 1)}
    s = status_of(w)
    assert s["phase"] == READY
    assert state(s, "Ready") == ("True", "AllComponentsReady")
    assert state(s, "Progressing") == ("False", "RolloutComplete")


def test_some_ready_is_progressing():
    w = all_pending()
    w["kvindex"] = workload(1, 1)
    s = status_of(w)
    assert s["phase"] == PROGRESSING
    assert cond(s, "Ready")["status"] == "False"
    assert "kvindex" not in cond(s, "Ready")["message"].split(":")[0]


def test_missing_workload_counts_as_not_ready():
    w = {"prefill": None, "decode": workload(1, 1), "proxy": workload(1, 1),
         "kvindex": workload(1, 1)}
    s = status_of(w)
    assert s["prefill"]["readyReplicas"] == 0
    assert cond(s, "Progressing")["reason"] == "RollingOut"


def test_unobserved_generation_is_not_ready():
    w = {c: workload(1, 1) for c in ("prefill", "decode", "proxy", "kvindex")}
    s = status_of(w, observed=2, generation=3)
    assert s["phase"] != READY
    assert cond(s, "Ready")["status"] == "False"
    assert cond(s, "Progressing")["reason"] == "NewGeneration"


def test_child_rollout_in_progress():
    w = {c: workload(1, 1) for c in ("prefill", "decode", "proxy", "kvindex")}
    w["decode"] = workload(2, 2, generation=5, observed=4)
    s = status_of(w)
    assert state(s, "Progressing") == ("True", "RollingOut")
    assert "decode" in cond(s, "Progressing")["message"]


def test_failure_is_degraded():
    s = status_of(all_pending(), failure=Failure("InvalidSpec", "spec.kvindex.replicas: no"))
    assert s["phase"] == DEGRADED
    assert state(s, "Degraded") == ("True", "InvalidSpec")
    assert cond(s, "Ready")["status"] == "False"
    assert cond(s, "Ready")["message"] == "spec.kvindex.replicas: no"


def test_transition_time_changes_only_with_status():
    first = status_of(all_pending(), now=T0)
    again = status_of(all_pending(), previous=first, now=T1)
    assert cond(again, "Ready")["lastTransitionTime"] == T0
    assert same_status(first, again)
    ready = status_of({c: workload(1, 1) for c in ("prefill", "decode", "proxy", "kvindex")},
                      previous=again, now=T1)
    assert cond(ready, "Ready")["lastTransitionTime"] == T1
    assert cond(ready, "Degraded")["lastTransitionTime"] == T0
    assert not same_status(again, ready)


def test_scaled_to_zero_is_ready():
    s = status_of({c: workload(0, 0) for c in ("prefill", "decode", "proxy", "kvindex")})
    assert s["phase"] == READY


def test_failure_without_workloads_has_no_empty_messages():
    s = status_of({}, failure=Failure("InvalidSpec", "spec.x: bad"))
    assert all(c["message"] for c in s["conditions"])
    assert state(s, "Progressing") == ("False", "InvalidSpec")
