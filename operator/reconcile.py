"""One reconcile pass and one status refresh, from the pure builders and status functions.

``reconcile`` applies every desired child (server-side apply: unchanged children stay
untouched, a changed field changes only its own child), prunes children the spec no longer
asks for, and writes the status. ``refresh_status`` recomputes the status when a child's
state changes (e.g. a pod becomes ready) without re-applying anything.
"""

from __future__ import annotations

import datetime
import logging
import time
from typing import Any

from kubernetes.client.exceptions import ApiException

from . import builders, metrics
from .builders import MANAGED_KINDS, Instance, SpecError
from .builders.common import API_VERSION, INSTANCE_LABEL, KIND, MANAGED_BY, MANAGED_BY_LABEL
from .kube import Kube
from .settings import OperatorSettings
from .status import Failure, compute_status, same_status

log = logging.getLogger(__name__)


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def children_selector(name: str) -> str:
    return f"{INSTANCE_LABEL}={name},{MANAGED_BY_LABEL}={MANAGED_BY}"


def reconcile(kube: Kube, settings: OperatorSettings, body: dict[str, Any]) -> dict[str, Any]:
    """Bring the children of one resource to its spec; returns the status written.
    Raises SpecError (after writing a Degraded status) when the spec cannot be served."""
    inst = Instance.from_body(body)
    generation = body["metadata"].get("generation", 1)
    started = time.monotonic()
    try:
        desired = builders.build_children(inst, settings)
    except SpecError as e:
        metrics.RECONCILES.labels("invalid_spec").inc()
        _write_status(kube, inst, body, generation, Failure("InvalidSpec", str(e)), applied={})
        raise
    applied: dict[tuple[str, str], dict[str, Any]] = {}
    try:
        for obj in desired:
            applied[(obj["kind"], obj["metadata"]["name"])] = kube.apply(obj)
            metrics.CHILDREN_APPLIED.labels(obj["kind"]).inc()
        prune(kube, inst, desired)
    except Exception as e:
        metrics.RECONCILES.labels("error").inc()
        _write_status(kube, inst, body, body.get("status", {}).get("observedGeneration", 0),
                      Failure("ReconcileFailed", f"{type(e).__name__}: {e}"[:1000]), applied={})
        raise
    metrics.RECONCILES.labels("applied").inc()
    metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)
    return _write_status(kube, inst, body, generation, None, applied)


def prune(kube: Kube, inst: Instance, desired: list[dict[str, Any]]) -> None:
    """Delete this resource's children of the managed kinds that are no longer desired."""
    wanted = {(o["apiVersion"], o["kind"], o["metadata"]["name"]) for o in desired}
    for api_version, kind in MANAGED_KINDS:
        for obj in kube.list(api_version, kind, inst.namespace, children_selector(inst.name)):
            owners = obj["metadata"].get("ownerReferences") or []
            if not any(o.get("uid") == inst.uid for o in owners):
                continue
            if (api_version, kind, obj["metadata"]["name"]) not in wanted:
                log.info("pruning %s %s/%s", kind, inst.namespace, obj["metadata"]["name"])
                kube.delete(api_version, kind, inst.namespace, obj["metadata"]["name"])
                metrics.CHILDREN_PRUNED.labels(kind).inc()


def refresh_status(kube: Kube, namespace: str, name: str, attempts: int = 3) -> None:
    """Recompute the status of one resource from its children, e.g. after a pod got ready.

    The write is conditional on the resource version it read, so it can never overwrite a
    newer status written by a concurrent reconcile; on a conflict it reads again."""
    for _ in range(attempts):
        body = kube.get(API_VERSION, KIND, namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return
        status = body.get("status") or {}
        if "observedGeneration" not in status:
            return  # not reconciled yet: the reconcile writes the first status
        failure = None
        if status.get("phase") == "Degraded":
            degraded = next((c for c in status.get("conditions", [])
                             if c["type"] == "Degraded"), {})
            failure = Failure(degraded.get("reason", "Degraded"), degraded.get("message", "-"))
        try:
            _write_status(kube, Instance.from_body(body), body, status["observedGeneration"],
                          failure, {}, resource_version=body["metadata"]["resourceVersion"])
            return
        except ApiException as e:
            if e.status == 404:
                return
            if e.status != 409:
                raise


def _workloads(kube: Kube, inst: Instance,
               applied: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for component, (kind, name) in builders.workloads(inst).items():
        obj = applied.get((kind, name))
        out[component] = obj if obj is not None else kube.get("apps/v1", kind, inst.namespace,
                                                               name)
    return out


def _write_status(kube: Kube, inst: Instance, body: dict[str, Any], observed_generation: int,
                  failure: Failure | None, applied: dict[tuple[str, str], dict[str, Any]],
                  resource_version: str | None = None) -> dict[str, Any]:
    previous = body.get("status") or {}
    try:
        workloads = {} if failure and failure.reason == "InvalidSpec" else _workloads(
            kube, inst, applied)
        selectors = {c: builders.selector_string(inst, c) for c in workloads}
    except SpecError:
        workloads, selectors = {}, {}
    status = compute_status(
        workloads=workloads, selectors=selectors, observed_generation=observed_generation,
        generation=body["metadata"].get("generation", 1), endpoint=builders.endpoint(inst),
        previous=previous, now=now(), failure=failure)
    metrics.READY.labels(inst.namespace, inst.name).set(1 if status["phase"] == "Ready" else 0)
    if same_status({k: previous.get(k) for k in status}, status) and not (
            set(previous) - set(status) - {"kopf"}):
        return status
    patch: dict[str, Any] = dict(status)
    for gone in set(previous) - set(status) - {"kopf"}:
        patch[gone] = None  # e.g. redis after inCluster was switched off
    kube.patch_status(API_VERSION, KIND, inst.namespace, inst.name, patch, resource_version)
    metrics.STATUS_WRITES.inc()
    return status
