"""The pods the proxy can send turns to: from flags, or followed in the kvindex's registry.

Keeps per-pod in-flight counts and queued prompt tokens (the load the routing policies
balance) and a short cool-down for pods that just failed, so a retry goes elsewhere. A pod
given by URL is matched to its kvindex name through the registry's ``api_url``, so KV-aware
routing can use its residency.

A registry that suddenly lists no pod at all, where it listed some, is not taken at once: an
outage of the kvindex's store longer than the pods' lease lapses every lease together although
every pod is up (their heartbeats found no store to land in), and the pods register again only
at their next heartbeat. For ``empty_registry_grace_s`` the proxy keeps routing to the pods it
knew (a pod really gone fails its turn over to another, as any dead pod does) rather than
refusing every turn with "no pods"; a registry that lists some pods is followed as it is.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import aiohttp

from agentserving.core.clients import KvindexClient, ServiceUnavailable
from agentserving.core.logging import get_logger
from agentserving.core.schemas import PodRole
from agentserving.proxy.jsonio import loads
from agentserving.proxy.routing import Candidate

log = get_logger(__name__)

FAILURE_COOLDOWN_S = 5.0


@dataclass
class PodState:
    name: str
    url: str
    role: PodRole
    model: str | None = None
    inflight: int = 0
    failed_until: float = 0.0
    queued_prompt_tokens: int = 0
    queued_prompts: int = 0  # turns whose prompt it is computing: its waiting queue
    max_model_len: int | None = None  # from its GET /v1/models
    stalled: bool = False  # went silent past a stall deadline; until it answers a probe
    probed_at: float | None = None

    def candidate(self) -> Candidate:
        return Candidate(self.name, self.url, self.inflight, self.queued_prompt_tokens,
                         queued_prompts=self.queued_prompts)


class QueuedPrompt:
    """A prompt a pod is computing for a turn, counted in the pod's ``queued_prompt_tokens``
    until the turn's first token (or its failure). ``done()`` may be called more than once. It
    finds the pod by name when done: the registry may have replaced the pod's state since."""

    def __init__(self, pool: PodPool, pod: str, tokens: int) -> None:
        self._pool, self._pod, self.tokens = pool, pod, max(0, tokens)
        self._pool._add_queued(pod, self.tokens, 1)

    def done(self) -> None:
        if self._pod is not None:
            self._pool._add_queued(self._pod, -self.tokens, -1)
            self._pod = None

    def __enter__(self) -> QueuedPrompt:
        return self

    def __exit__(self, *exc: object) -> None:
        self.done()


class PodPool:
    def __init__(self, prefill_urls: list[str], decode_urls: list[str],
                 kvindex: KvindexClient | None, empty_registry_grace_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._static = bool(prefill_urls or decode_urls)
        self._kvindex = kvindex
        self._pods: dict[str, PodState] = {}
        self._grace_s = empty_registry_grace_s
        self._clock = clock
        self._emptied_at: float | None = None  # when the registry last went from some to none
        for url in prefill_urls:
            self._pods[url] = PodState(url, url.rstrip("/"), PodRole.PREFILL)
        for url in decode_urls:
            self._pods[url] = PodState(url, url.rstrip("/"), PodRole.DECODE)
        if self._static and not decode_urls:  # no decode pool: prefill pods do both
            for pod in self._pods.values():
                pod.role = PodRole.BOTH

    # -- membership
    async def refresh(self) -> bool:
        """Follow the kvindex registry; returns False when the kvindex is unreachable."""
        if self._kvindex is None:
            return True
        try:
            registered = (await self._kvindex.pods()).pods
        except ServiceUnavailable:
            return False
        if self._static:  # learn the kvindex names of the pods we were given
            by_url = {p.api_url.rstrip("/"): p for p in registered if p.api_url}
            for pod in self._pods.values():
                reg = by_url.get(pod.url)
                if reg is not None:
                    pod.name, pod.model = reg.pod, reg.model
            return True
        current = {}
        for reg in registered:
            if not reg.api_url:
                continue
            old = self._pods.get(reg.pod)
            state = PodState(reg.pod, reg.api_url.rstrip("/"), reg.role, reg.model)
            if old is not None:
                state.inflight, state.failed_until = old.inflight, old.failed_until
                state.queued_prompt_tokens = old.queued_prompt_tokens
                state.max_model_len, state.stalled = old.max_model_len, old.stalled
                state.probed_at = old.probed_at
            current[reg.pod] = state
        if not current and self._pods and self._keep_last_known():
            return True
        self._emptied_at = None
        if set(current) != set(self._pods):
            log.info("pods_changed", pods=sorted(current))
        self._pods = current
        return True

    def _keep_last_known(self) -> bool:
        """The registry lists none of the pods it listed: keep them, for the grace period."""
        now = self._clock()
        if self._emptied_at is None:
            self._emptied_at = now
            log.warning("registry_lists_no_pods_keeping_last_known", pods=sorted(self._pods),
                        grace_s=self._grace_s)
        return now - self._emptied_at < self._grace_s

    async def follow(self, interval_s: float) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(interval_s)

    # -- views
    def _healthy(self, pods: list[PodState]) -> list[PodState]:
        now = time.monotonic()
        ok = [p for p in pods if p.failed_until <= now and not p.stalled]
        return ok or pods  # all recently failed: try them anyway rather than refuse

    def prefill_candidates(self) -> list[Candidate]:
        pods = [p for p in self._pods.values() if p.role in (PodRole.PREFILL, PodRole.BOTH)]
        return [p.candidate() for p in self._healthy(pods)]

    def decode_candidates(self) -> list[Candidate]:
        pods = [p for p in self._pods.values() if p.role is PodRole.DECODE]
        return [p.candidate() for p in self._healthy(pods)]

    def models(self) -> list[str]:
        return sorted({p.model for p in self._pods.values() if p.model})

    def all(self) -> list[PodState]:
        return list(self._pods.values())

    # -- load and health
    def _find(self, name: str) -> PodState | None:
        return next((p for p in self._pods.values() if p.name == name), None)

    def acquire(self, name: str) -> None:
        if (pod := self._find(name)) is not None:
            pod.inflight += 1

    def release(self, name: str) -> None:
        if (pod := self._find(name)) is not None:
            pod.inflight = max(0, pod.inflight - 1)

    @contextmanager
    def reserved(self, name: str) -> Iterator[None]:
        """Counts a turn on a pod before it sends the pod anything: a P/D turn's decode pod
        from the moment it is chosen, through the prefill stage, so that turns routed meanwhile
        see it taken (else two first turns, one in its prefill stage, land on one decode pod
        while the other idles: bench-agent on vLLM, December 2026)."""
        self.acquire(name)
        try:
            yield
        finally:
            self.release(name)

    def queue_prompt(self, name: str, tokens: int) -> QueuedPrompt:
        return QueuedPrompt(self, name, tokens)

    def _add_queued(self, name: str, tokens: int, prompts: int) -> None:
        if (pod := self._find(name)) is not None:
            pod.queued_prompt_tokens = max(0, pod.queued_prompt_tokens + tokens)
            pod.queued_prompts = max(0, pod.queued_prompts + prompts)

    def mark_failed(self, name: str) -> None:
        if (pod := self._find(name)) is not None:
            pod.failed_until = time.monotonic() + FAILURE_COOLDOWN_S

    def mark_stalled(self, name: str) -> None:
        """Out of rotation until it answers a probe (``probe``): unlike a failed pod, a
        stalled one is not tried again after a cool-down, since it would take the turn and
        go silent again."""
        if (pod := self._find(name)) is not None and not pod.stalled:
            pod.stalled = True
            log.warning("pod_stalled", pod=name)

    def stalled(self) -> list[str]:
        return sorted(p.name for p in self._pods.values() if p.stalled)

    def max_model_len(self) -> int | None:
        """The largest context a pod reports: a turn past it fits no pod."""
        return max((p.max_model_len for p in self._pods.values() if p.max_model_len),
                   default=None)

    # -- probes
    async def probe(self, http: aiohttp.ClientSession, timeout_s: float,
                    unknown_every_s: float = 30.0) -> None:
        """Ask ``GET /v1/models`` of every stalled pod (one that answers is back in rotation)
        and of every pod whose context length is unknown (at most every
        ``unknown_every_s``): the pods answer it on every engine, and it carries their
        ``max_model_len``."""
        now = time.monotonic()
        due = [p for p in self._pods.values() if p.stalled or (
            p.max_model_len is None and (p.probed_at is None
                                         or now - p.probed_at >= unknown_every_s))]
        await asyncio.gather(*(self._probe_one(http, p, timeout_s) for p in due))

    async def _probe_one(self, http: aiohttp.ClientSession, pod: PodState,
                         timeout_s: float) -> None:
        pod.probed_at = time.monotonic()
        try:
            async with http.get(pod.url + "/v1/models",
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                if resp.status != 200:
                    return
                payload = loads(await resp.read())
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return
        lengths = [m.get("max_model_len") for m in (payload.get("data") or [])
                   if isinstance(m, dict)] if isinstance(payload, dict) else []
        known = [n for n in lengths if isinstance(n, int) and n > 1]
        if known:
            pod.max_model_len = max(known)
        if pod.stalled:
            pod.stalled = False
            log.info("pod_answers_again", pod=pod.name)
