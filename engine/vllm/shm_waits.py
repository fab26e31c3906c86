"""How vLLM's engine core and worker processes wait on each other, on a CPU host.

The two processes talk through vLLM's shared-memory queues
(``vllm.distributed.device_communicators.shm_broadcast``). A reader that read a message less
than a second ago spins for the next one (``sched_yield`` in a loop); after that it sleeps on
a ZMQ notification the writer sends with each message, and re-checks the shared memory every
5 s in case the notification was lost. Both choices are made for GPU hosts, and both hurt on
vLLM-CPU, where the worker computes on the very cores the waiting process holds:

- the spin: while a pod's worker computed, its engine core took 60-70 % of a core
  (``top``, three vLLM-CPU pods on 2 cores, December 2026);
- lost notifications: with the spin turned off (every wait a ZMQ poll), all three pods of a
  replay stopped within seconds, each with a request running and nothing computing, until the
  5 s re-check. vLLM's own comment on that re-check says it bounds "lost-notify recovery";
  with its 1 s spin a pod meets it on the first message after an idle second, which on a pod
  that idles between turns (a prefill pod) is the first step of a turn.

So, in vLLM's engine core and worker processes (``engine/vllm/launch.py`` applies this there):
within the spin window a reader sleeps ``nap_s`` between checks of the shared memory instead
of spinning, and an idle reader re-checks it every ``recheck_ms`` instead of every 5 s. A
lost notification then costs at most ``recheck_ms``, and a wait costs a wake-up per
``nap_s`` instead of a core.

Exercised against vLLM-CPU 0.32.0's real queues (``engine/vllm/tests/test_shm_waits_vllm.py``)
and its pods (``agentserving compare``); on a GPU host the defaults leave vLLM's spin alone and
only shorten the re-check.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

NAP_ENV = "AGENTSERVING_VLLM_SHM_NAP_S"
RECHECK_ENV = "AGENTSERVING_VLLM_SHM_RECHECK_MS"
CPU_NAP_S = 0.0005
DEFAULT_RECHECK_MS = 50


@dataclass(frozen=True)
class ShmWaits:
    nap_s: float  # 0: vLLM's own spin (sched_yield)
    recheck_ms: int


def shm_waits(environ: Mapping[str, str], on_cpu: bool) -> ShmWaits:
    """The waits a vLLM process should use: the environment's, else the host's defaults."""
    nap, recheck = environ.get(NAP_ENV, ""), environ.get(RECHECK_ENV, "")
    waits = ShmWaits(nap_s=float(nap) if nap else (CPU_NAP_S if on_cpu else 0.0),
                     recheck_ms=int(recheck) if recheck else DEFAULT_RECHECK_MS)
    if waits.nap_s < 0 or waits.recheck_ms < 1:
        raise ValueError(f"{NAP_ENV}={nap!r} must be >= 0 and {RECHECK_ENV}={recheck!r} >= 1")
    return waits


def install(waits: ShmWaits) -> None:
    """Replace ``SpinCondition.wait`` in this process (idempotent)."""
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    stock = getattr(SpinCondition.wait, "stock", SpinCondition.wait)

    def wait(self: SpinCondition, timeout_ms: int | None = None) -> None:
        if waits.nap_s and time.monotonic() <= self.last_read + self.busy_loop_s:
            time.sleep(waits.nap_s)  # the caller checks the shared memory again
            return
        stock(self, waits.recheck_ms if timeout_ms is None
              else min(timeout_ms, waits.recheck_ms))

    wait.stock = stock  # type: ignore[attr-defined]
    SpinCondition.wait = wait  # type: ignore[method-assign]


def install_from_env(on_cpu: bool) -> ShmWaits:
    waits = shm_waits(os.environ, on_cpu)
    install(waits)
    return waits
