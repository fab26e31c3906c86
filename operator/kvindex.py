"""The finalizer's kvindex clean-up: forget a deleted resource's worker pods.

Best effort and bounded: it lists the kvindex's registered pods (``GET /v1/pods``) and
removes the ones whose names belong to the resource's pools (``DELETE /v1/pods/{pod}``, which
also drops their residency) until a deadline. A kvindex that is gone, unreachable or slow
only shortens the clean-up; it never raises, so it never blocks the resource's deletion.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import httpx


@dataclass
class CleanupResult:
    removed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    error: str = ""


def pool_prefixes(name: str, pools: tuple[str, ...] = ("prefill", "decode")) -> tuple[str, ...]:
    """StatefulSet pods are named <statefulset>-<ordinal>: <name>-prefill-0, ..."""
    return tuple(f"{name}-{pool}-" for pool in pools)


def forget_pods(base_url: str, prefixes: tuple[str, ...], timeout_s: float,
                transport: httpx.BaseTransport | None = None) -> CleanupResult:
    result = CleanupResult()
    deadline = time.monotonic() + timeout_s

    def left() -> float:
        return max(deadline - time.monotonic(), 0.0)

    try:
        with httpx.Client(base_url=base_url.rstrip("/"), transport=transport,
                          timeout=httpx.Timeout(min(timeout_s, 2.0))) as client:
            resp = client.get("/v1/pods", timeout=left())
            resp.raise_for_status()
            pods = [p["pod"] for p in resp.json().get("pods", []) if isinstance(p, dict)]
            for pod in sorted(p for p in pods if isinstance(p, str) and p.startswith(prefixes)):
                if left() <= 0:
                    result.failed.append(pod)
                    continue
                try:
                    r = client.delete(f"/v1/pods/{pod}", timeout=left())
                    if r.status_code in (200, 202, 204, 404):
                        result.removed.append(pod)
                    else:
                        result.failed.append(pod)
                except httpx.HTTPError:
                    result.failed.append(pod)
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result
