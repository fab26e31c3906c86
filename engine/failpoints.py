"""Failpoints: faults a test or the fault bench injects where no harm from outside reaches.

Most KV faults can be made from outside a pod: a disk chunk deleted or flipped, a KV server
killed, a pod stopped. A layer copy into vLLM's pages runs inside the forward pass, from DRAM
to DRAM, and nothing outside makes it fail; yet its fallback (``engine.vllm.fallbacks``: the
request recomputed, with the same tokens) must be shown on a real pod. A failpoint is a named
place in that code that raises ``InjectedFault`` while it is armed.

Off unless the engine process starts with ``AGENTSERVING_FAILPOINTS=1`` (the test fleets and
``python -m bench faults`` set it; a deployment never does): then its memory API serves
``POST /memory/failpoints`` (arm ``name`` for its next ``times`` hits) and
``GET /memory/failpoints`` (what is still armed). Without it there is no route, and ``hit``
costs one dict lookup.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Literal

from fastapi import APIRouter
from pydantic import Field

from agentserving.core.schemas import Strict

ENV = "AGENTSERVING_FAILPOINTS"
# layer_copy: a layer-wise load's copy of a layer into vLLM's pages (engine.vllm.paged_cpu)
Name = Literal["layer_copy"]

_armed: dict[str, int] = {}
_lock = threading.Lock()


class InjectedFault(RuntimeError):
    """Raised at an armed failpoint."""


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(ENV, "") == "1"


def arm(name: str, times: int) -> None:
    with _lock:
        if times > 0:
            _armed[name] = times
        else:
            _armed.pop(name, None)


def armed() -> dict[str, int]:
    with _lock:
        return dict(_armed)


def hit(name: str) -> None:
    """Raise ``InjectedFault`` if ``name`` is armed, using up one of its hits."""
    if not _armed:
        return
    with _lock:
        left = _armed.get(name, 0)
        if left <= 0:
            return
        if left == 1:
            del _armed[name]
        else:
            _armed[name] = left - 1
    raise InjectedFault(f"failpoint {name} (injected)")


class ArmRequest(Strict):
    name: Name = Field(description="The failpoint: layer_copy (a layer-wise KV load's copy "
                       "into the engine's pages).")
    times: int = Field(default=1, ge=0, le=1_000_000,
                       description="Its next this many hits fail; 0 disarms it.")


class Armed(Strict):
    armed: dict[str, int] = Field(description="Failpoints still armed: hits left to fail.")


def router() -> APIRouter:
    """The memory API's failpoint routes (mount only where ``enabled()``)."""
    api = APIRouter()

    @api.post("/memory/failpoints", response_model=Armed,
              summary="Arm a failpoint for its next hits (test and fault-bench pods only).")
    def arm_route(req: ArmRequest) -> Armed:
        arm(req.name, req.times)
        return Armed(armed=armed())

    @api.get("/memory/failpoints", response_model=Armed,
             summary="The failpoints still armed.")
    def armed_route() -> Armed:
        return Armed(armed=armed())

    return api
