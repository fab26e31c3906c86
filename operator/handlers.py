"""kopf handlers: each reads the event, calls reconcile/status/kvindex code, and returns.

``register`` adds them to a kopf registry, so the CLI decides what runs and with which
settings (kept in kopf's ``memo``: ``memo.settings``, ``memo.kube``).
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from . import kvindex, metrics, reconcile
from .builders import POOLS, SpecError, derive_token
from .builders.common import INSTANCE_LABEL, MANAGED_BY, MANAGED_BY_LABEL
from .kube import Kube, load_client_config
from .settings import OperatorSettings

GROUP, VERSION, PLURAL = "agentserving.io", "v1alpha1", "agentservings"
FINALIZER = "agentserving.io/finalizer"
CHILD_LABELS = {MANAGED_BY_LABEL: MANAGED_BY}


def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix="agentserving.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="agentserving.io", key="last-handled-configuration")
    settings.posting.level = logging.WARNING  # Kubernetes events only for problems
    settings.watching.server_timeout = 300
    memo.kube = Kube(load_client_config(), memo.settings.field_manager)


def apply_children(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    try:
        status = reconcile.reconcile(memo.kube, memo.settings, dict(body))
    except SpecError as e:
        raise kopf.PermanentError(str(e)) from e
    logger.info("reconciled: phase %s", status["phase"])


def resync(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    if (body.get("status") or {}).get("phase") != "Degraded":
        reconcile.reconcile(memo.kube, memo.settings, dict(body))


def child_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    meta = body["metadata"]
    if meta.get("labels", {}).get(INSTANCE_LABEL):
        reconcile.refresh_status(memo.kube, meta["namespace"], meta["labels"][INSTANCE_LABEL])


async def forget_in_kvindex(name: str, namespace: str, uid: str, memo: kopf.Memo,
                            logger: logging.Logger, **_: Any) -> None:
    settings: OperatorSettings = memo.settings
    token = (derive_token(settings.token_key, namespace, name, uid)
             if settings.token_key else None)
    result = await kvindex.forget_pods(settings.kvindex_url(name, namespace),
                                       kvindex.pool_prefixes(name, POOLS),
                                       settings.cleanup_timeout_s, token=token)
    metrics.KVINDEX_CLEANUP_PODS.labels("removed").inc(len(result.removed))
    metrics.KVINDEX_CLEANUP_PODS.labels("failed").inc(len(result.failed))
    if result.error:
        metrics.KVINDEX_CLEANUP_ERRORS.inc()
    metrics.READY.remove(namespace, name) if (namespace, name) in _ready_labels() else None
    logger.info("kvindex clean-up: removed %s, failed %s, error %r", result.removed,
                result.failed, result.error)


def _ready_labels() -> set[tuple[str, ...]]:
    return {tuple(s.labels.values()) for m in metrics.READY.collect() for s in m.samples}


def register(registry: kopf.OperatorRegistry, settings: OperatorSettings) -> None:
    """Register every handler; settings are only used for timer intervals here."""
    on, res = kopf.on, (GROUP, VERSION, PLURAL)
    on.startup(registry=registry)(configure)
    # Log in like kubectl: in-cluster ServiceAccount, else $KUBECONFIG (kubernetes client).
    on.login(registry=registry)(kopf.login_via_client)
    for cause in (on.resume, on.create, on.update):
        cause(*res, registry=registry, id="apply-children")(apply_children)
    kopf.timer(*res, registry=registry, interval=settings.resync_interval_s,
               initial_delay=settings.resync_interval_s, idle=None, id="resync")(resync)
    for plural in ("statefulsets", "deployments"):
        on.event("apps", "v1", plural, labels=CHILD_LABELS, registry=registry,
                 id=f"status-from-{plural}")(child_changed)
    on.delete(*res, registry=registry, id="forget-in-kvindex")(forget_in_kvindex)
