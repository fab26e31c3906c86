"""Keeps a pod registered with the kvindex without reporting residency: the sidecar of
vLLM-Ascend pods, whose residency reaches the kvindex from LMCache-Ascend's own controller
messages (the kvindex's LMCache controller endpoint drops batches for unregistered pods), and
of plain vLLM pods, whose residency is their own KV event stream (``--residency vllm-events``,
the kvindex's ``--vllm-events``).

It registers (memory API URL, OpenAI URL, role, model, hash scheme, chunk size), renews the
lease, registers again when the kvindex no longer knows the pod (restart, lapsed lease), and
deregisters on SIGTERM. It never sends a snapshot: that would overwrite what the controller
path reported. ``python -m agentserving.engine.vllm.registrar --help`` (its command line and
settings: ``registrar_cli``).
"""

from __future__ import annotations

import asyncio
import signal

from agentserving.core.clients import KvindexClient, NotFound, RequestRejected, ServiceUnavailable
from agentserving.core.logging import get_logger
from agentserving.core.schemas import PodRegistration
from agentserving.engine.vllm.registrar_cli import RegistrarSettings, main

log = get_logger(__name__)


class Registrar:
    def __init__(self, client: KvindexClient, registration: PodRegistration,
                 interval_s: float = 5.0) -> None:
        self.client = client
        self.registration = registration
        self.interval_s = interval_s
        self.registered = False

    async def tick(self) -> str:
        """One round: register if needed, else renew. Returns what it did (tests, logs)."""
        try:
            if not self.registered:
                await self.client.register(self.registration)
                self.registered = True
                log.info("kvindex_registered", pod=self.registration.pod)
                return "registered"
            await self.client.heartbeat(self.registration.pod)
            return "renewed"
        except NotFound:
            self.registered = False  # forgotten: register on the next round
            return "unknown"
        except (ServiceUnavailable, RequestRejected) as exc:
            log.warning("kvindex_unreachable", pod=self.registration.pod, error=repr(exc))
            return "down"

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if await self.tick() == "unknown":
                continue
            try:
                await asyncio.wait_for(stop.wait(), self.interval_s)
            except TimeoutError:
                pass
        if self.registered:
            try:
                await asyncio.wait_for(self.client.deregister(self.registration.pod), 2.0)
            except (ServiceUnavailable, RequestRejected, TimeoutError):
                pass
        await self.client.aclose()


async def run(settings: RegistrarSettings) -> None:
    """Register, renew until SIGTERM/SIGINT, deregister."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    client = KvindexClient(settings.kvindex, timeout_s=2.0, token=settings.internal_token)
    registrar = Registrar(client, settings.registration(), settings.interval_s)
    await registrar.run(stop)


if __name__ == "__main__":
    main(run)
