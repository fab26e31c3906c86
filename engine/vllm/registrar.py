"""Keeps a pod registered with the kvindex without reporting residency: the sidecar of
vLLM-Ascend pods, whose residency reaches the kvindex from LMCache-Ascend's own controller
messages (the kvindex's LMCache controller endpoint drops batches for unregistered pods), and
of plain vLLM pods, whose residency is their own KV event stream (``--residency vllm-events``,
the kvindex's ``--vllm-events``).

It registers (memory API URL, OpenAI URL, role, model, hash scheme, chunk size), renews the
lease, registers again when the kvindex no longer knows the pod (restart, lapsed lease), and
deregisters on SIGTERM. It never sends a snapshot: that would overwrite what the controller
path reported. ``python -m agentserving.engine.vllm.registrar --help``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from collections.abc import Sequence

from agentserving.core.clients import KvindexClient, NotFound, RequestRejected, ServiceUnavailable
from agentserving.core.hashing import DEFAULT_CHUNK_SIZE, HashScheme
from agentserving.core.internal_auth import TOKEN_ENV, TOKEN_HELP
from agentserving.core.logging import get_logger
from agentserving.core.schemas import PodRegistration, PodRole

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


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m agentserving.engine.vllm.registrar",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--kvindex", required=True, help="kvindex base URL")
    p.add_argument("--pod", required=True, help="this pod's name")
    p.add_argument("--memory-api-url", required=True, help="the pod's memory API (:6999)")
    p.add_argument("--api-url", required=True, help="the pod's OpenAI API")
    p.add_argument("--role", choices=[r.value for r in PodRole], default="both")
    p.add_argument("--model", required=True, help="served model name")
    p.add_argument("--hash-scheme", choices=[s.value for s in HashScheme],
                   default="lmcache-builtin")
    p.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE)
    p.add_argument("--interval", type=float, default=5.0, help="lease renewal, seconds")
    p.add_argument("--engine", default="vllm-ascend", help="the pod's engine label")
    p.add_argument("--residency", default="lmcache-controller",
                   help="where its residency comes from (label): lmcache-controller, "
                        "vllm-events")
    p.add_argument("--internal-token", default=os.environ.get(TOKEN_ENV),
                   help=f"{TOKEN_HELP} Default: ${TOKEN_ENV}.")
    return p.parse_args(argv)


def registration_of(args: argparse.Namespace) -> PodRegistration:
    return PodRegistration(pod=args.pod, memory_api_url=args.memory_api_url,
                           api_url=args.api_url, role=PodRole(args.role), model=args.model,
                           hash_scheme=HashScheme(args.hash_scheme), chunk_size=args.chunk_size,
                           labels={"engine": args.engine, "residency": args.residency})


async def _main(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    registrar = Registrar(KvindexClient(args.kvindex, timeout_s=2.0, token=args.internal_token),
                          registration_of(args), args.interval)
    await registrar.run(stop)


def main(argv: Sequence[str] | None = None) -> None:
    asyncio.run(_main(parse_args(argv)))


if __name__ == "__main__":
    main()
