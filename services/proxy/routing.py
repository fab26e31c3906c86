"""Routing policies: which prefill pod serves a turn, and which decode pod finishes it.

Pure: each policy gets the candidates (with their load and, for kv-aware, their cached prefix
from the kvindex) and returns an ordered preference list; the orchestrator tries them in order
and falls back to the next one when a pod fails. Chosen by name from config.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from agentserving.core.hashing import DEFAULT_CHUNK_SIZE
from agentserving.core.schemas import PodPrefix


@dataclass(frozen=True)
class Candidate:
    name: str
    url: str
    inflight: int = 0
    # prompt tokens the proxy sent this pod to compute whose first token has not come back:
    # its prefill queue, as far as the proxy knows (token-id prompts; 0 for what it cannot size)
    queued_prompt_tokens: int = 0
    # decode pods: the work its sessions have given it lately, in the load's prompt tokens
    # (``proxy.pod_activity``)
    recent_work: float = 0.0
    queued_prompts: int = 0  # turns whose prompt it is computing (its waiting queue)


@dataclass
class RouteInput:
    session_key: str | None
    candidates: Sequence[Candidate]
    prefixes: dict[str, PodPrefix] = field(default_factory=dict)  # from the kvindex lookup
    last_pod: str | None = None  # where this session's previous turn ran
    index_available: bool = True
    prompt_chunks: int = 0  # the prompt's full chunks (the kvindex lookup's length)


class RoutingPolicy(Protocol):
    name: str
    uses_index: bool  # ranks by the kvindex's prefixes: the proxy looks the prompt up

    def rank(self, inp: RouteInput) -> list[Candidate]: ...


def queued_work(c: Candidate, turn_tokens: int) -> int:
    """A pod's queue in prompt tokens: its turns in flight, each weighed as ``turn_tokens``,
    plus the prompt tokens it has yet to compute."""
    return c.inflight * turn_tokens + c.queued_prompt_tokens


def _by_load(candidates: Sequence[Candidate]) -> list[Candidate]:
    return sorted(candidates, key=lambda c: (c.inflight, c.name))


class RoundRobin:
    """Spread turns evenly, ignoring sessions and KV: the baseline of the benchmarks."""

    name = "round-robin"
    uses_index = False

    def __init__(self) -> None:
        self._counter = itertools.count()

    def rank(self, inp: RouteInput) -> list[Candidate]:
        pods = sorted(inp.candidates, key=lambda c: c.name)
        if not pods:
            return []
        start = next(self._counter) % len(pods)
        return pods[start:] + pods[:start]


def affinity_order(session_key: str | None, candidates: Sequence[Candidate]) -> list[Candidate]:
    """Rendezvous hashing: a session keeps its pod while the pod set is stable, and only the
    sessions of a pod that leaves move."""
    if session_key is None:
        return _by_load(candidates)

    def weight(c: Candidate) -> bytes:
        return hashlib.blake2b(f"{session_key}|{c.name}".encode(), digest_size=8).digest()

    return sorted(candidates, key=weight, reverse=True)


class SessionAffinity:
    """A session's turns stay on one pod (its previous one while it lives)."""

    name = "session"
    uses_index = False

    def rank(self, inp: RouteInput) -> list[Candidate]:
        order = affinity_order(inp.session_key, inp.candidates)
        if inp.last_pod is not None:
            order.sort(key=lambda c: c.name != inp.last_pod)
        return order


class KvAware:
    """Go where the longest tier-weighted prefix is, unless that pod is too busy.

    cost(pod) = -cached_tokens(pod) + load_penalty_tokens * inflight(pod), where
    cached_tokens = kvindex score (device 1, DRAM 0.8, disk 0.5 per chunk) * chunk_size. Without
    the index (down, or a first turn) it degrades to session affinity.
    """

    name = "kv-aware"
    uses_index = True

    def __init__(self, chunk_size: int = DEFAULT_CHUNK_SIZE, load_penalty_tokens: int = 2048
                 ) -> None:
        self.chunk_size = chunk_size
        self.load_penalty_tokens = load_penalty_tokens
        self._fallback = SessionAffinity()

    def cost(self, c: Candidate, prefixes: dict[str, PodPrefix]) -> float:
        prefix = prefixes.get(c.name)
        cached = prefix.score * self.chunk_size if prefix else 0.0
        return -cached + self.load_penalty_tokens * c.inflight

    def rank(self, inp: RouteInput) -> list[Candidate]:
        if not inp.index_available or not inp.prefixes:
            return self._fallback.rank(inp)
        affinity = {c.name: i for i, c in enumerate(self._fallback.rank(inp))}
        return sorted(inp.candidates,
                      key=lambda c: (self.cost(c, inp.prefixes), affinity[c.name]))


class LeastLoaded:
    """Decode pods: the one with the least work queued. Work is turns in flight, each weighed
    as ``turn_tokens`` prompt tokens, plus the prompt tokens the pod has yet to compute (turns
    run whole on it): a pod computing a 6,000-token first turn is busier than one decoding two
    appends, though it has fewer turns in flight (bench-agent on vLLM, run 3 of December 2026:
    five of the seven slowest turns queued on one decode pod behind such a first turn). Among
    equally loaded pods, the session's previous decode pod first (it holds the session's
    chunks, so it pulls only the new suffix from the prefill pod), then the session's
    rendezvous order (first turns spread over the pool). With nothing queued the order is by
    turns in flight alone. A session with no decode pod yet goes to the pod with the least
    recent work plus load (``Candidate.recent_work``): it will come back there for many turns,
    so what a pod's sessions have been asking of it counts beside what it is computing this
    instant."""

    name = "least-loaded"
    uses_index = False

    def __init__(self, turn_tokens: int = 2048) -> None:
        self.turn_tokens = max(1, turn_tokens)

    def load(self, c: Candidate) -> int:
        return queued_work(c, self.turn_tokens)

    def rank(self, inp: RouteInput) -> list[Candidate]:
        affinity = {c.name: i for i, c in enumerate(affinity_order(inp.session_key,
                                                                   inp.candidates))}
        new_session = inp.last_pod is None
        return sorted(inp.candidates, key=lambda c: (
            self.load(c) + (c.recent_work if new_session else 0.0), c.name != inp.last_pod,
            affinity[c.name]))


@dataclass(frozen=True)
class LlmdWeights:
    """llm-d's scheduler as its precise prefix-cache guide configures it (llm-d-router's
    ``epp-precise-prefix-cache-config.yaml``; the guide's scheduler values): scorer weights
    prefix 2, kv-cache utilization 1, queue 1; the precise index's tier weights (its
    ``DefaultKVCacheBackendConfig``: gpu 1.0, cpu 0.8; a disk tier, which its CPU guide does
    not deploy, weighs as this project's kvindex weighs it); and its utilization saturation
    detector's queue-depth threshold (5)."""

    prefix: float = 2.0
    kv_utilization: float = 1.0
    queue: float = 1.0
    saturation_queue_depth: int = 5


class LlmdScheduler:
    """The rival router of the benchmarks: llm-d's endpoint picker, mirrored.

    - **session stickiness until saturation** (llm-d 1.0's session-aware routing: its
      session-affinity filter after the utilization filter): a session whose pod is not
      saturated goes back to it; a saturated pod (more than ``saturation_queue_depth`` turns
      waiting for their first token) is left out, and the session moves to the best other
      pod, where it stays;
    - otherwise the highest weighted score: prefix = the tier-weighted longest cached prefix
      over the prompt's chunks (the precise scorer's ``weightedScore / totalBlocks``, in
      [0, 1]; the kvindex weighs device 1, DRAM 0.8, disk 0.5 per chunk, as llm-d's index
      weighs gpu 1.0 and cpu 0.8); queue = (max - q) / (max - min) over the candidates' waiting
      turns (all equal: 1).

    Where it differs from llm-d: the waiting queue is the proxy's count of a pod's turns
    without a first token (llm-d scrapes vLLM's ``num_requests_waiting``); the kv-cache
    utilization scorer and the detector's KV threshold (0.8) have no input here (the pods do
    not report their KV usage to the proxy), so that scorer adds the same to every pod and
    saturation is by queue alone; ties go to the session's rendezvous order (llm-d picks at
    random among equal scores)."""

    name = "llm-d"
    uses_index = True

    def __init__(self, weights: LlmdWeights = LlmdWeights()) -> None:
        self.weights = weights

    def saturated(self, c: Candidate) -> bool:
        return c.queued_prompts > self.weights.saturation_queue_depth

    def score(self, c: Candidate, inp: RouteInput, queues: tuple[int, int]) -> float:
        w = self.weights
        prefix = inp.prefixes.get(c.name)
        matched = min(1.0, prefix.score / inp.prompt_chunks) \
            if prefix is not None and inp.prompt_chunks else 0.0
        low, high = queues
        queue = 1.0 if high == low else (high - c.queued_prompts) / (high - low)
        return w.prefix * matched + w.queue * queue + w.kv_utilization * 1.0

    def rank(self, inp: RouteInput) -> list[Candidate]:
        pods = list(inp.candidates)
        if not pods:
            return []
        open_pods = [c for c in pods if not self.saturated(c)] or pods
        is_open = {c.name for c in open_pods}
        queues = (min(c.queued_prompts for c in open_pods),
                  max(c.queued_prompts for c in open_pods))
        affinity = {c.name: i for i, c in enumerate(affinity_order(inp.session_key, pods))}
        return sorted(pods, key=lambda c: (
            c.name not in is_open, c.name != inp.last_pod,
            -self.score(c, inp, queues), affinity[c.name]))


def make_policy(name: str, chunk_size: int = DEFAULT_CHUNK_SIZE,
                load_penalty_tokens: int = 2048) -> RoutingPolicy:
    if name == "kv-aware":
        return KvAware(chunk_size, load_penalty_tokens)
    if name == "session":
        return SessionAffinity()
    if name == "llm-d":
        return LlmdScheduler()
    if name == "round-robin":
        return RoundRobin()
    raise ValueError(f"unknown routing policy '{name}'; expected kv-aware, llm-d, session, "
                     "round-robin")
