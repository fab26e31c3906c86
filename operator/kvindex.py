"""The finalizer's kvindex clean-up: forget a deleted resource's worker pods.

Best effort and bounded: it lists the kvindex's registered pods (``GET /v1/pods``) and
removes the ones whose names belong to the resource's pools (``DELETE /v1/pods/{pod}``, which
also drops their residency) until a deadline, through the same ``KvindexClient`` every other
component speaks the kvindex with. A kvindex that is gone, unreachable, slow or answering
garbage only shortens the clean-up; it never raises, so it never blocks the resource's
deletion.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import httpx
from pydantic import ValidationError

from agentserving.core.clients import KvindexClient, NotFound, RequestRejected, ServiceUnavailable


@dataclass
class CleanupResult:
    removed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    error: str = ""


def pool_prefixes(name: str, pools: tuple[str, ...] = ("prefill", "decode")) -> tuple[str, ...]:
    """StatefulSet pods are named <statefulset>-<ordinal>: <name>-prefill-0, ..."""
    return tuple(f"{name}-{pool}-" for pool in pools)


async def forget_pods(base_url: str, prefixes: tuple[str, ...], timeout_s: float,
                      transport: httpx.AsyncBaseTransport | None = None,
                      token: str | None = None) -> CleanupResult:
    result = CleanupResult()
    pending: list[str] = []
    async with httpx.AsyncClient(transport=transport,
                                 timeout=httpx.Timeout(min(timeout_s, 2.0))) as http:
        client = KvindexClient(base_url, client=http, token=token)
        try:
            async with asyncio.timeout(timeout_s):
                listed = await client.pods()
                pending = sorted(p.pod for p in listed.pods if p.pod.startswith(prefixes))
                while pending:
                    pod = pending.pop(0)
                    try:
                        await client.deregister(pod)
                        result.removed.append(pod)
                    except NotFound:  # gone already: what the clean-up wanted
                        result.removed.append(pod)
                    except (ServiceUnavailable, RequestRejected):
                        result.failed.append(pod)
        except TimeoutError:
            result.error = f"TimeoutError: no answer within {timeout_s:g} s"
        except (ServiceUnavailable, RequestRejected, ValidationError) as e:
            result.error = f"{type(e).__name__}: {e}"
    result.failed += pending  # not reached before the deadline
    return result
