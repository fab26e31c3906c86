"""The operator's Prometheus metrics (served by ``agentserving operator --metrics-port``)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

RECONCILES = Counter(
    "agentserving_operator_reconciles_total",
    "Reconcile passes, by result (applied, invalid_spec, error).", ["result"])
RECONCILE_SECONDS = Histogram(
    "agentserving_operator_reconcile_seconds", "Duration of one reconcile pass.")
CHILDREN_APPLIED = Counter(
    "agentserving_operator_children_applied_total", "Child objects server-side applied.", ["kind"])
CHILDREN_PRUNED = Counter(
    "agentserving_operator_children_pruned_total", "Child objects deleted as no longer wanted.",
    ["kind"])
STATUS_WRITES = Counter(
    "agentserving_operator_status_writes_total", "Status subresource patches.")
KVINDEX_CLEANUP_PODS = Counter(
    "agentserving_operator_kvindex_cleanup_pods_total",
    "Pods the finalizer asked the kvindex to forget, by result (removed, failed).", ["result"])
KVINDEX_CLEANUP_ERRORS = Counter(
    "agentserving_operator_kvindex_cleanup_errors_total",
    "Finalizer clean-ups that could not reach or read the kvindex.")
READY = Gauge(
    "agentserving_operator_resource_ready",
    "1 when an AgentServing resource is Ready, else 0.", ["namespace", "name"])
