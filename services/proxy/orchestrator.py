"""One agent turn through the proxy: route, run prefill then decode, remember, prefetch.

The flow, as vLLM's disaggregated proxy examples run it: the prefill pod gets the request with
``max_tokens: 1`` and ``kv_transfer_params: {"do_remote_decode": true}`` and answers with where
its KV is; the decode pod gets the original request with those params and generates. With no
decode pool, the prefill pod does both. A turn whose decode pod already holds the session's
context and would compute only a few prompt tokens skips the prefill pod (``disagg``). A pod
that fails before the caller saw a byte is retried on the next pod of the policy's ranking; the
caller always gets an answer or an OpenAI-shaped error, never silence.

Before any of it, a turn that cannot finish within the model's context is refused
(``context_limit``). A pod that takes a request, goes silent past its stage's deadline
(``stalls``) and then does not answer a probe (``liveness``: a busy pod answers, a stopped one
does not) fails over as a dead pod does and is kept out of rotation until it answers again: a
stream is moved only while nothing reached the caller (its first token is read before the
answer starts), after which it ends with an error event whose code is ``stalled``.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, TypeVar

import aiohttp
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import Counter

from agentserving.core.clients import (
    KvindexClient,
    NotFound,
    RequestRejected,
    ServiceUnavailable,
)
from agentserving.core.logging import get_logger
from agentserving.core.schemas import (
    POD_NAME_PATTERN,
    TENANT_HEADER,
    LookupRequest,
    LookupResponse,
    PodPrefix,
    PodRole,
    PrefetchRequest,
    SessionContext,
)
from agentserving.core.schemas import (
    PROMPT_SOURCES_PARAM as SOURCES_KEY,
)
from agentserving.core.service import ApiError
from agentserving.proxy import memory_hooks
from agentserving.proxy.admission import AdmissionGate, Ticket
from agentserving.proxy.context_limit import context_error
from agentserving.proxy.disagg import (
    Placement,
    PromptSize,
    local_prefill_tokens,
    plan_local_pod,
    prompt_size,
)
from agentserving.proxy.liveness import PodLiveness, http_probe
from agentserving.proxy.memory_hooks import AgentMemory
from agentserving.proxy.metrics import ProxyMetrics
from agentserving.proxy.pod_activity import PodActivity
from agentserving.proxy.pods import PodPool, QueuedPrompt
from agentserving.proxy.prompt_hashes import prompt_chunk_hashes
from agentserving.proxy.request_hints import with_pin_xarg
from agentserving.proxy.residency_replica import ResidencyReplica
from agentserving.proxy.routing import Candidate, LeastLoaded, RouteInput, RoutingPolicy
from agentserving.proxy.sessions import SessionState, SessionTable, session_key
from agentserving.proxy.settings import ProxySettings
from agentserving.proxy.stalls import StallDeadlines, policy_from
from agentserving.proxy.tool_gaps import (
    H_AT_ANNOUNCE,
    ToolGapPredictor,
    at_announce_header,
    pin_ttl_for_gap,
    prefetch_found,
)
from agentserving.proxy.upstream import (
    UPSTREAM_ERRORS,
    InterTokenStall,
    PrefillReport,
    Stalled,
    StreamReply,
    TurnOutcome,
    UpstreamFailed,
    open_stream,
    open_watched_stream,
    post_json,
    post_watched,
    relay_sse,
)

log = get_logger(__name__)
T = TypeVar("T")
_POD_NAME = re.compile(POD_NAME_PATTERN)
# --announce-hold 0 holds nothing: a waiting turn's KV is read for again this often
DEFAULT_RETELL_S = 10.0

H_PREFILL = "x-agentserving-prefill-pod"
H_DECODE = "x-agentserving-decode-pod"
H_ROUTING = "x-agentserving-routing"
H_DEGRADED = "x-agentserving-degraded"
H_NEXT_TOOL = "x-agentserving-next-tool"
H_PD = "x-agentserving-pd"  # "disaggregated", or "local": prefilled on the decode pod
# the pods a turn was moved off before it was answered (comma-separated, in order): a caller
# (or a fault bench) can tell a turn saved by a retry from one that never met a failure
H_RETRIED = "x-agentserving-retried"
H_ADMISSION = "x-agentserving-admission"  # --admit-per-pod: how the turn was let in, and its wait


Attempt = tuple[Candidate, Candidate | None]  # (pod that prefills, decode pod or None)


@dataclass
class Routed:
    """The policy's rankings, and what the kvindex said on the way: a later question about
    the same chunks (conditional disaggregation's) is answered from it, not asked again."""

    prefill: list[Candidate]
    decode: list[Candidate]
    prefixes: dict[str, PodPrefix] = field(default_factory=dict)
    asked: list[str] | None = None  # the chunk hashes the kvindex answered about

    def held_chunks(self, pod: str, hashes: list[str]) -> int | None:
        """Leading chunks of ``hashes`` ``pod`` holds, if the kvindex was asked about them."""
        if self.asked is None or self.asked != hashes:
            return None
        found = self.prefixes.get(pod)
        return found.prefix_chunks if found is not None else 0


@dataclass
class Turn:
    """One request as the proxy sees it."""

    endpoint: str  # "/v1/completions" or "/v1/chat/completions"
    body: dict[str, Any]
    session_id: str | None
    session_key: str | None
    tenant: str | None = None
    parent_session_id: str | None = None
    memory: AgentMemory | None = None
    next_tool: str | None = None
    announce_next: bool = False  # nvext.agent_hints.speculative_prefill
    started: float = field(default_factory=time.perf_counter)
    headers: dict[str, str] = field(default_factory=dict)
    queued_prompt: QueuedPrompt | None = None  # a stream's prompt, until its first token
    # its place at the fleet's door: until its first token, or a P/D turn's prefill stage
    admission: Ticket | None = None
    last_resort: bool = False  # the attempt under way is the turn's last: no stall deadline

    def prompt_computed(self) -> None:
        if self.queued_prompt is not None:
            self.queued_prompt.done()
        if self.admission is not None:
            self.admission.release()

    @cached_property
    def prompt_size(self) -> PromptSize:
        """Sized once per turn (a scan of a token-id prompt): placement, conditional
        disaggregation, the pod's queue and the session's record all ask."""
        return prompt_size(self.endpoint, self.body)

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def upstream_headers(self) -> dict[str, str] | None:
        """What the pods are told besides the body: the caller's tenant, which labels their
        reuse metrics (the cache_salt, not this, keeps tenants' chunks apart)."""
        return {TENANT_HEADER: self.tenant} if self.tenant else None


class Orchestrator:
    def __init__(self, settings: ProxySettings, pool: PodPool, kvindex: KvindexClient | None,
                 policy: RoutingPolicy, http: aiohttp.ClientSession, metrics: ProxyMetrics,
                 replica: ResidencyReplica | None = None) -> None:
        self.settings = settings
        self.pool = pool
        self.kvindex = kvindex
        self.replica = replica
        self.policy = policy
        self.http = http
        self.metrics = metrics
        self.sessions = SessionTable(settings.max_sessions, settings.session_idle_ttl_s)
        self.tool_gaps = ToolGapPredictor()
        self._decode_policy = LeastLoaded(settings.load_penalty_tokens)
        self.activity = PodActivity(settings.activity_half_life_s)
        self._prefetch_tasks: dict[str, asyncio.Task] = {}
        self._background: set[asyncio.Task] = set()
        self.stalls = StallDeadlines(policy_from(settings))
        self.liveness = PodLiveness(
            lambda url: http_probe(self.http, url, settings.stall_probe_timeout_s),
            fresh_s=min(settings.probe_interval_s, 1.0))
        self._prober: asyncio.Task | None = None
        self._stall_signals: dict[str, asyncio.Event] = {}  # set when the pod is found stalled
        self._context_asked = False
        # the gate looks ahead only for the queued prefetch, which is asked for again once
        # its hold has lapsed
        self.admission = AdmissionGate(
            settings.admit_per_pod, settings.admit_max_wait_s, self._pod_count,
            lookahead=2 if settings.queued_prefetch else 0,
            retell_s=settings.announce_hold_s or DEFAULT_RETELL_S) \
            if settings.admit_per_pod > 0 else None

    # ------------------------------------------------------------------ entry point
    async def handle(self, turn: Turn) -> JSONResponse | StreamingResponse:
        self._start_prober()
        await self._check_context(turn)
        state = self.sessions.get(turn.session_key) if turn.session_key else SessionState()
        self.metrics.sessions.set(len(self.sessions))
        await self._adopt_shared_route(turn, state)
        self._on_arrival(turn, state)
        self._resolve_pin(turn)
        if turn.parent_session_id and state.turns == 0 and self.settings.fork_placement:
            await self._fork(turn, state)
        if turn.memory and self.kvindex and turn.session_id:
            await memory_hooks.before_turn(self.kvindex.for_tenant(turn.tenant),
                                           turn.session_id, turn.memory, self._record_hook)
        turn.admission = await self._admit(turn, state)
        try:
            response = await self._place_and_run(turn, state)
        except BaseException:
            turn.prompt_computed()
            raise
        if not isinstance(response, StreamingResponse):  # a stream frees it at its first token
            turn.prompt_computed()
        return response

    async def _place_and_run(self, turn: Turn, state: SessionState
                             ) -> JSONResponse | StreamingResponse:
        routed = await self._route(turn, state)
        attempts = self._attempts(routed.prefill, routed.decode,
                                  await self._local_pod(turn, state, routed))
        if not attempts:
            self.metrics.failures.labels("no_pods").inc()
            raise ApiError(503, "no worker pods available", type="service_unavailable",
                           code="no_pods")
        prefill, decode = attempts[0]
        self.activity.turn_placed(*self._work_placed(turn, state, prefill, decode))
        if turn.stream:
            return await self._run_streaming(turn, state, attempts)
        return await self._run_blocking(turn, state, attempts)

    async def _admit(self, turn: Turn, state: SessionState) -> Ticket | None:
        """--admit-per-pod: wait for this turn's place among the prompts the fleet computes,
        by the tokens it would compute on the session's own pod (its whole prompt if it has
        none; a prompt the proxy cannot size weighs as one turn of load)."""
        if self.admission is None:
            return None
        await self._ensure_pods()
        cost = self._tokens_to_compute(turn, state, own_pod=state.last_decode_pod is not None)
        with self.metrics.admission_waiting.track_inprogress():
            ticket = await self.admission.admit(
                self._decode_policy.turn_tokens if cost is None else cost,
                on_next=lambda: self._prefetch_while_queued(turn, state))
        self.metrics.admission_wait.labels(ticket.how.value).observe(ticket.waited_s)
        turn.headers[H_ADMISSION] = f"{ticket.how.value}; waited={ticket.waited_s:.3f}s"
        return ticket

    def _prefetch_while_queued(self, turn: Turn, state: SessionState) -> None:
        """--queued-prefetch: a turn waiting for admission, once it is among the next to go
        (the gate's look-ahead), has its session's pod read the session's KV from disk, and
        hold it in DRAM for --announce-hold seconds: a loaded fleet keeps turns waiting for
        tens of seconds, in which the pods' other turns evict what DRAM held when the wait
        began (a read then would be evicted again, and so would a hold on it, within the pin
        share, of every waiting session); read just before its place, the KV is in DRAM when
        the turn gets there. Not awaited; a kvindex that fails it fails no turn."""
        s = self.settings
        if not (s.queued_prefetch and self.kvindex is not None and turn.session_id
                and state.chunk_hashes and state.last_pod):
            return
        request = PrefetchRequest(
            chunk_hashes=list(state.chunk_hashes), pod=state.last_pod,
            lookup_id=f"queued:{turn.session_id}",
            hold_s=s.announce_hold_s if s.announce_hold_s > 0 else None)
        self._spawn(self._prefetch_counted(request, "queued_prefetch",
                                           self.metrics.queued_prefetch_chunks))

    async def _prefetch_counted(self, request: PrefetchRequest, op: str, chunks: Counter
                                ) -> dict[str, int] | None:
        """A prefetch through the kvindex, recorded as the memory hook ``op`` and its chunks
        counted in ``chunks`` by where the pods found them (``prefetch_found``, returned);
        None when the kvindex failed it (a prefetch fails no turn)."""
        assert self.kvindex is not None
        try:
            answer = await self.kvindex.prefetch(request)
        except (ServiceUnavailable, RequestRejected):
            self._record_hook(op, False)
            return None
        self._record_hook(op, True)
        found = prefetch_found(answer.results)
        for where, n in found.items():
            chunks.labels(where).inc(n)
        return found

    def _pod_count(self) -> int:
        return len(self.pool.prefill_candidates()) + len(self.pool.decode_candidates())

    def _resolve_pin(self, turn: Turn) -> None:
        """A pin asked for without a TTL gets one from the tool-gap prediction (the tool the
        caller names, else the mean over all), within the floor and cap; the turn's pin then
        goes to the pod too (``vllm_xargs``), whose engine may hold its blocks for it. With
        ``--tool-pin``, a turn whose caller names the tool it ends in asks for such a pin
        unless its ``agent_memory`` says otherwise."""
        if turn.memory is None and self._tool_pins(turn):
            turn.memory = AgentMemory(pin=True)
        mem = turn.memory
        if mem is None or (mem.pin_ttl_s is None and not mem.pin):
            return
        ttl_s = mem.pin_ttl_s
        if ttl_s is None:
            ttl_s = self._pin_ttl(turn.next_tool)
            turn.memory = mem.model_copy(update={"pin_ttl_s": ttl_s, "pin": False})
        with_pin_xarg(turn.body, ttl_s)

    def _pin_ttl(self, tool: str | None) -> float:
        s = self.settings
        return round(pin_ttl_for_gap(self.tool_gaps.predict(tool), s.pin_ttl_floor_s,
                                     s.pin_ttl_cap_s, s.pin_gap_multiple), 3)

    def _tool_pins(self, turn: Turn, tool: str | None = None) -> bool:
        """Whether ``--tool-pin`` pins the session after this turn: it ends in a tool call
        (``tool``: one its answer called) and the agent will be back when the tool returns."""
        return bool(self.settings.tool_pin and turn.session_id and (turn.next_tool or tool))

    async def context_length(self) -> int | None:
        """The model's context length: the flag's, else the pods' (asked once up front when no
        pod's is known yet, then kept current by the prober); None: unknown."""
        limit = self.settings.max_model_len or self.pool.max_model_len()
        if limit is None and not self._context_asked:
            self._context_asked = True
            await self._ensure_pods()
            await self.pool.probe(self.http, self.settings.stall_probe_timeout_s)
            limit = self.pool.max_model_len()
        return limit

    async def _check_context(self, turn: Turn) -> None:
        """A 400 naming the field for a turn that fits no pod's context (``context_limit``)."""
        limit = await self.context_length()
        error = context_error(turn.endpoint, turn.body, turn.prompt_size, limit)
        if error is not None:
            self.metrics.failures.labels("context_length").inc()
            raise error

    def _start_prober(self) -> None:
        if self._prober is None or self._prober.done():
            self._prober = self._spawn(self._probe_forever())

    async def _probe_forever(self) -> None:
        """Stalled pods back in rotation once they answer; context lengths learned."""
        while True:
            await asyncio.sleep(self.settings.probe_interval_s)
            try:
                await self.pool.probe(self.http, self.settings.stall_probe_timeout_s)
            except Exception as exc:  # a probe round must never end the prober
                log.warning("probe_round_failed", error=repr(exc))
            self.metrics.stalled_pods.set(len(self.pool.stalled()))

    def _work_placed(self, turn: Turn, state: SessionState, prefill: Candidate,
                     decode: Candidate | None) -> tuple[str, float]:
        """The pod whose sessions' activity a placed turn adds to, and how much: a P/D turn
        the decode pod's fixed share of a turn, a turn run whole that plus its prompt."""
        work = self._decode_policy.turn_tokens
        if decode is None:
            return prefill.name, work + self._prompt_to_compute(turn, state, prefill)
        return decode.name, work

    def _prompt_to_compute(self, turn: Turn, state: SessionState, pod: Candidate) -> int:
        """Prompt tokens ``pod`` computes running this turn whole (0 for a prompt the proxy
        cannot size without a tokenizer)."""
        n = self._tokens_to_compute(turn, state, own_pod=pod.name == state.last_decode_pod)
        return 0 if n is None else n

    def _tokens_to_compute(self, turn: Turn, state: SessionState, own_pod: bool) -> int | None:
        """The new suffix on the session's own pod, the whole prompt elsewhere (cache hits on
        another pod are not known here); None for a prompt the proxy cannot size."""
        size = turn.prompt_size
        if size.tokens is None:
            return None
        held = state.held(self.settings.chunk_size) if own_pod else None
        new = local_prefill_tokens(size, held) if held is not None else None
        return new if new is not None else size.tokens

    # ------------------------------------------------------------------ routing
    async def _route(self, turn: Turn, state: SessionState) -> Routed:
        t0 = time.perf_counter()
        await self._ensure_pods()
        candidates = self.pool.prefill_candidates()
        prefixes: dict[str, PodPrefix] = {}
        asked = None
        index_ok = True
        # One prefill pod leaves nothing to choose: the lookup (a kvindex round trip, the
        # larger part of the proxy's added latency) is only made when it can change the order.
        hashes = self._lookup_hashes(turn, state) if len(candidates) > 1 else None
        if self.kvindex is not None and hashes and self.policy.uses_index:
            try:
                found = await self._lookup(LookupRequest(
                    chunk_hashes=hashes, pods=[c.name for c in candidates],
                    role=PodRole.PREFILL))
                prefixes = {p.pod: p for p in found.pods}
                asked = hashes
            except (ServiceUnavailable, RequestRejected) as exc:
                index_ok = False
                self.metrics.degraded.inc()
                turn.headers[H_DEGRADED] = "kvindex-unavailable; routed by session affinity"
                log.warning("kvindex_unavailable_routing_by_affinity", error=str(exc))
        prefill_order = self.policy.rank(RouteInput(turn.session_key, candidates, prefixes,
                                                    state.last_pod, index_ok,
                                                    prompt_chunks=len(hashes or ())))
        decode_order = self._decode_policy.rank(
            RouteInput(turn.session_key, [replace(c, recent_work=self.activity.level(c.name))
                                          for c in self.pool.decode_candidates()],
                       last_pod=state.last_decode_pod))
        turn.headers[H_ROUTING] = self.policy.name
        self.metrics.overhead.observe(time.perf_counter() - t0)
        return Routed(prefill_order, decode_order, prefixes, asked)

    async def _lookup(self, req: LookupRequest) -> LookupResponse:
        """The in-process replica's answer while it is fresh, else the kvindex's (which raises
        as the kvindex client does)."""
        if self.replica is not None and (found := self.replica.lookup(req)) is not None:
            self.metrics.lookups.labels("replica").inc()
            return found
        assert self.kvindex is not None
        self.metrics.lookups.labels("kvindex").inc()
        return await self.kvindex.lookup(req)

    def _lookup_hashes(self, turn: Turn, state: SessionState) -> list[str] | None:
        """What the kvindex is asked about: the prompt's own hashes (--prompt-hash-scheme),
        else the chunk hashes the pods returned on the session's previous turn."""
        scheme = self.settings.prompt_hash_scheme
        own = prompt_chunk_hashes(turn.endpoint, turn.body, scheme, self.settings.chunk_size) \
            if scheme is not None else None
        return own or state.chunk_hashes

    async def _local_pod(self, turn: Turn, state: SessionState, routed: Routed
                         ) -> Candidate | None:
        """Conditional disaggregation (``disagg.plan_local_pod``, which the simulator runs
        too): the pod this turn runs whole on, or None for P/D. The plan's one question, how
        much of the context the first-ranked prefill pod holds, is answered from routing's
        kvindex answer when it was about the same chunks, else asked."""
        prefill_order, decode_order = routed.prefill, routed.decode
        hosts = self._hosts(prefill_order, decode_order)
        own = next((c for c in [*decode_order, *hosts] if c.name == state.last_decode_pod), None)
        size = turn.prompt_size
        held = None if own is None else state.held(self.settings.chunk_size)
        s = self.settings
        placement = Placement(size, held, own, prefill_order, decode_order, hosts,
                              s.local_prefill_tokens, s.max_prefill_backlog, s.balance_tokens,
                              self._decode_policy.turn_tokens)
        plan = plan_local_pod(placement)
        if plan.ask is not None:
            assert size.tokens is not None  # the planner asks only about a sized prompt
            plan = plan_local_pod(placement, await self._pod_lacks(
                state, routed, plan.ask, size.tokens))
        return plan.pod

    def _hosts(self, prefill_order: list[Candidate], decode_order: list[Candidate]
               ) -> list[Candidate]:
        """The prefill pods that may be a session's own pod (--prefill-hosts-sessions or
        --balance-tokens, beside a decode pool)."""
        s = self.settings
        hosting = s.prefill_hosts_sessions or s.balance_tokens > 0
        return prefill_order if hosting and decode_order else []

    async def _pod_lacks(self, state: SessionState, routed: Routed, pod: str, tokens: int
                         ) -> int | None:
        """Prompt tokens ``pod`` would compute for this turn, by the kvindex (None: unknown);
        routing's own answer is used when it was about these chunks."""
        if self.kvindex is None or not state.chunk_hashes:
            return None
        held = routed.held_chunks(pod, state.chunk_hashes)
        if held is None:
            try:
                found = await self._lookup(LookupRequest(
                    chunk_hashes=state.chunk_hashes, pods=[pod]))
            except (ServiceUnavailable, RequestRejected):
                return None
            held = max((p.prefix_chunks for p in found.pods if p.pod == pod), default=0)
        return tokens - held * self.settings.chunk_size

    async def _ensure_pods(self) -> None:
        if not self.pool.prefill_candidates():
            await self.pool.refresh()

    # ------------------------------------------------------------------ blocking
    async def _first_reply(self, turn: Turn, state: SessionState, attempts: list[Attempt], fn
                           ) -> tuple[Candidate, Candidate | None, Any, PrefillReport | None]:
        """The first attempt whose pods answer, with ``fn`` (``post_json`` or ``open_stream``)
        for the pod that answers the caller: (prefill pod, decode pod or None, its reply, what
        the prefill pod reported of the prompt, or None when one pod ran the turn whole). A pod
        that fails is not asked again this turn; when all have failed, a 502 naming the last
        error. A pod running the turn whole counts its prompt as queued until the reply (a
        stream: its first token, ``Turn.prompt_computed``)."""
        last_error = "no attempt made"
        failed: set[str] = set()
        for i, (prefill, decode) in enumerate(attempts):
            if prefill.name in failed or (decode is not None and decode.name in failed):
                continue
            # the last pods left get no stall deadline: with nowhere to move the turn, it
            # waits for a stopped pod to resume (SIGCONT, a node back) until --upstream-timeout
            turn.last_resort = next(untried(attempts[i + 1:], failed), None) is None
            try:
                if decode is None:
                    queued = self.pool.queue_prompt(
                        prefill.name, self._prompt_to_compute(turn, state, prefill))
                    try:
                        resp = await self._call(prefill, self._solo_stage(prefill), fn,
                                                turn.body, turn)
                    except BaseException:
                        queued.done()
                        raise
                    if turn.stream:
                        turn.queued_prompt = queued
                    else:
                        queued.done()
                    return prefill, None, resp, None
                with self.pool.reserved(decode.name), self.pool.queue_prompt(
                        prefill.name, self._prompt_to_compute(turn, state, prefill)):
                    params, report = await self._prefill_for_decode(turn, prefill)
                if turn.admission is not None:  # its prompt is computed: the place is free
                    turn.admission.release()
                # released and re-acquired by _call with no await between: never uncounted
                return prefill, decode, await self._call(
                    decode, "decode", fn, self._decode_body(turn.body, params), turn), \
                    report
            except UpstreamFailed as exc:
                last_error = str(exc)
                failed.add(exc.pod)
                turn.headers[H_RETRIED] = ",".join(
                    [*filter(None, turn.headers.get(H_RETRIED, "").split(",")), exc.pod])
                self._retrying(exc)
        self.metrics.failures.labels("upstream").inc()
        raise ApiError(502, f"every worker failed this turn; last error: {last_error}",
                       type="upstream_error", code="all_pods_failed", headers=turn.headers)

    async def _run_blocking(self, turn: Turn, state: SessionState, attempts: list[Attempt]
                            ) -> JSONResponse:
        prefill, decode, resp, report = await self._first_reply(turn, state, attempts,
                                                                post_json)
        payload = resp.json() if resp.headers.get("content-type", "").startswith(
            "application/json") else None
        if resp.is_success and isinstance(payload, dict):
            outcome = TurnOutcome()
            outcome.absorb(payload)
            if report is not None:
                report.patch(payload)
                outcome.cached_tokens = report.cached_tokens
            self._finish(turn, state, prefill, outcome, decode)
            self.metrics.ttft.observe(time.perf_counter() - turn.started)
            return JSONResponse(payload, status_code=resp.status_code, headers=turn.headers)
        self.metrics.failures.labels("rejected").inc()
        return JSONResponse(payload if payload is not None else {"error": {
            "message": resp.text[:500], "type": "upstream_error"}},
            status_code=resp.status_code, headers=turn.headers)

    # ------------------------------------------------------------------ streaming
    async def _run_streaming(self, turn: Turn, state: SessionState, attempts: list[Attempt]
                             ) -> JSONResponse | StreamingResponse:
        prefill, decode, resp, report = await self._first_reply(turn, state, attempts,
                                                                open_stream)
        if not resp.is_success:  # the worker rejected the request: pass its verdict on
            turn.prompt_computed()
            content = await resp.aread()
            await resp.aclose()
            self.metrics.failures.labels("rejected").inc()
            return JSONResponse(_json_or_error(content), status_code=resp.status_code,
                                headers=turn.headers)
        self.pool.acquire((decode or prefill).name)
        return StreamingResponse(
            self._stream_body(turn, state, prefill, decode, resp, report),
            media_type="text/event-stream", headers=turn.headers)

    async def _stream_body(self, turn: Turn, state: SessionState, prefill: Candidate,
                           decode: Candidate | None, resp: StreamReply,
                           report: PrefillReport | None) -> AsyncIterator[bytes]:
        serving = decode or prefill
        outcome = TurnOutcome()
        first = True
        # The stream's end ([DONE] and what follows) is held until the turn is recorded: a
        # client that sends its next turn the moment it reads [DONE] must find the session's
        # decode pod and context already known, or that turn is routed as a first turn.
        tail: list[bytes] = []
        try:
            async for chunk in relay_sse(resp, outcome, report):
                if first:
                    self.metrics.ttft.observe(time.perf_counter() - turn.started)
                    turn.prompt_computed()
                    first = False
                if tail or chunk.startswith(b"data: [DONE]"):
                    tail.append(chunk)
                else:
                    yield chunk
            if report is not None and report.cached_tokens is not None:
                outcome.cached_tokens = report.cached_tokens
            self._finish(turn, state, prefill, outcome, decode)
            for chunk in tail:
                yield chunk
        except UPSTREAM_ERRORS as exc:  # the pod died mid-stream: tell the caller, in-band
            if isinstance(exc, InterTokenStall):  # tokens reached the caller: no moving it
                self._stalled(serving.name, "prefill" if decode is None else "decode",
                              "inter_token")
                self.metrics.failures.labels("stalled").inc()
                yield _sse_error(f"worker {serving.name} stalled mid-stream: no token within "
                                 f"{exc.deadline_s:.3g}s", code="stalled")
            else:
                self.pool.mark_failed(serving.name)
                self.metrics.failures.labels("mid_stream").inc()
                yield _sse_error(f"worker {serving.name} failed mid-stream: {exc!r}")
        finally:
            turn.prompt_computed()
            self.pool.release(serving.name)
            await resp.aclose()

    # ------------------------------------------------------------------ P/D pieces
    def _attempts(self, prefill_order: list[Candidate], decode_order: list[Candidate],
                  local_pod: Candidate | None = None) -> list[Attempt]:
        """(prefill, decode) pairs to try in order; decode pods rotate with the attempts. A
        turn run whole on its decode pod is ``(decode pod, None)``, tried first; the P/D pairs
        follow it as fallbacks. The last resorts, after the P/D pairs, are the other decode
        pods, each running the turn whole: a prefill pool that is down (rolling, its only pod
        restarting) while decode pods terminate one by one costs the turn its prefill
        speed-up, never the turn (a roll can leave the first of them a pod just removed)."""
        n = self.settings.max_attempts
        pairs: list[Attempt] = [(local_pod, None)] if local_pod is not None else []
        for i in range(min(n, max(len(prefill_order), len(decode_order) or 1))
                       if prefill_order else 0):
            prefill = prefill_order[i % len(prefill_order)]
            decode = decode_order[i % len(decode_order)] if decode_order else None
            pairs.append((prefill, decode))
        pairs = pairs[:n]
        pairs += [(d, None) for d in decode_order
                  if local_pod is None or d.name != local_pod.name]
        return pairs

    def _solo_stage(self, pod: Candidate) -> str:
        """A pod serving a turn alone: a prefill pod (no decode pool), or a pod serving as a
        session's own (a decode pod, or a prefill pod hosting sessions): "local"."""
        decode = self.pool.decode_candidates()
        if any(pod.name == d.name for d in decode):
            return "local"
        return "local" if self._hosts([pod], decode) else "prefill"

    async def _prefill_for_decode(self, turn: Turn, prefill: Candidate
                                  ) -> tuple[dict[str, Any], PrefillReport]:
        body = dict(turn.body)  # shallow: only top-level keys change; the prompt is shared
        body.update(stream=False, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        body.pop("stream_options", None)
        body.pop("max_completion_tokens", None)
        resp = await self._call(prefill, "prefill", post_json, body, turn)
        if not resp.is_success:
            raise UpstreamFailed(prefill.name, f"prefill rejected: HTTP {resp.status_code} "
                                 f"{resp.text[:200]}")
        payload = resp.json()
        params = payload.get("kv_transfer_params")
        if params is None:
            params = {}  # nothing to hand over (vLLM: no full chunk): the decode pod computes
        if not isinstance(params, dict):
            raise UpstreamFailed(prefill.name, "prefill answer's kv_transfer_params is not an "
                                 "object")
        outcome = TurnOutcome()
        outcome.absorb(payload)
        params.pop(SOURCES_KEY, None)  # the prefill pod's figures, for the caller alone
        return params, PrefillReport(outcome.cached_tokens, outcome.prompt_sources)

    @staticmethod
    def _decode_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        out = dict(body)
        if params:  # an empty hand-off is a plain request: there is nothing to pull
            out["kv_transfer_params"] = {**params, "do_remote_prefill": True,
                                         "do_remote_decode": False}
        return out

    async def _call(self, pod: Candidate, stage: str, fn, body: dict[str, Any], turn: Turn
                    ) -> Any:  # type: ignore[no-untyped-def]
        if stage == "local":  # the decode pod prefills too
            turn.headers.update({H_PREFILL: pod.name, H_DECODE: pod.name, H_PD: "local"})
        else:
            turn.headers[H_PREFILL if stage == "prefill" else H_DECODE] = pod.name
            if stage == "decode":
                turn.headers[H_PD] = "disaggregated"
        self.metrics.routed.labels(stage, pod.name, self.policy.name).inc()
        self.pool.acquire(pod.name)
        try:
            if not self.settings.stall_detection or turn.last_resort:
                return await fn(self.http, pod.name, pod.url + turn.endpoint, body,
                                turn.upstream_headers)
            return await self._watched(pod, "decode" if stage == "decode" else "prefill",
                                       fn, body, turn)
        except Stalled as exc:  # out until it answers a probe, not for a cool-down
            self._stalled(pod.name, "decode" if stage == "decode" else "prefill", exc.kind)
            raise
        except UpstreamFailed:
            self.pool.mark_failed(pod.name)
            raise
        finally:
            self.pool.release(pod.name)

    async def _watched(self, pod: Candidate, stage: str, fn, body: dict[str, Any], turn: Turn
                       ) -> Any:  # type: ignore[no-untyped-def]
        """One upstream call under its stage's stall deadlines, feeding them what it observes
        (a stream its first token and gaps, P/D's prefill call its answer). Silence past a
        deadline asks the pod for a sign of life (``liveness``); a blocking answer is silent
        until its last token, so it is asked every first-token deadline while it lasts."""
        first, gap = self._deadline(stage, "first_token"), self._deadline(stage, "inter_token")
        url = pod.url + turn.endpoint
        if fn is open_stream:
            reply = await self._unless_stalled(pod.name, open_watched_stream(
                self.http, pod.name, url, body, turn.upstream_headers, first, gap,
                on_gap=lambda s: self.stalls.observe(stage, "inter_token", s),
                alive=self._alive(pod, stage)))
            if reply.is_success and reply.first_token_s is not None:
                self.stalls.observe(stage, "first_token", reply.first_token_s)
            return reply
        n = body.get("max_completion_tokens", body.get("max_tokens"))
        t0 = time.perf_counter()
        reply = await self._unless_stalled(pod.name, post_watched(
            self.http, pod.name, url, body, turn.upstream_headers, first,
            self._alive(pod, stage)))
        if stage == "prefill" and n == 1 and reply.is_success:  # P/D's prefill call
            self.stalls.observe(stage, "first_token", time.perf_counter() - t0)
        return reply

    def _alive(self, pod: Candidate, stage: str) -> Callable[[], Awaitable[bool]]:
        """Asked when a call to ``pod`` has gone silent past its deadline: does the pod still
        answer a probe? Counted by answer, so a pool busier than its deadlines shows."""
        async def alive() -> bool:
            answered = await self.liveness.answers(pod.url)
            self.metrics.silent_probes.labels(stage, "answered" if answered else "silent").inc()
            return answered
        return alive

    async def _unless_stalled(self, pod: str, call: Coroutine[Any, Any, T]) -> T:
        """``call``, unless another turn finds ``pod`` stalled first: then ``Stalled`` at once.
        Every turn waiting on a pod that another turn's probe found stopped moves at once,
        without waiting out its own deadline and probe."""
        signal = self._stall_signals.setdefault(pod, asyncio.Event())
        task, waiter = asyncio.ensure_future(call), asyncio.ensure_future(signal.wait())
        t0 = time.perf_counter()
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            raise
        finally:
            waiter.cancel()
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise Stalled(pod, "first_token", time.perf_counter() - t0)

    def _deadline(self, stage: str, kind: str) -> float:
        deadline = self.stalls.deadline(stage, kind)
        self.metrics.stall_deadline.labels(stage, kind).set(deadline)
        return deadline

    def _stalled(self, pod: str, stage: str, kind: str) -> None:
        self.metrics.stalls.labels(stage, kind).inc()
        self.pool.mark_stalled(pod)
        if (signal := self._stall_signals.pop(pod, None)) is not None:
            signal.set()  # the other turns waiting on it move too
        self.metrics.stalled_pods.set(len(self.pool.stalled()))

    def _retrying(self, exc: UpstreamFailed) -> None:
        self.metrics.retries.labels("upstream").inc()
        log.warning("upstream_failed_retrying", pod=exc.pod, reason=exc.reason)

    # ------------------------------------------------------------------ after the turn
    def _finish(self, turn: Turn, state: SessionState, prefill: Candidate,
                outcome: TurnOutcome, decode: Candidate | None = None) -> None:
        self.metrics.e2e.observe(time.perf_counter() - turn.started)
        if outcome.prompt_tokens:
            self.metrics.prompt_tokens.labels(prefill.name).inc(outcome.prompt_tokens)
        if outcome.cached_tokens:
            self.metrics.cached_tokens.labels(prefill.name).inc(outcome.cached_tokens)
        state.turns += 1
        state.last_pod = prefill.name
        if decode is not None:
            state.last_decode_pod = decode.name
        elif self._solo_stage(prefill) == "local":
            # run whole on a decode pod (its first turn, the prefill pool saturated) or on a
            # prefill pod hosting sessions: the session's context is there now, and so are
            # its next appends
            state.last_decode_pod = prefill.name
        if outcome.chunk_hashes is not None:
            state.chunk_hashes = outcome.chunk_hashes
        state.prompt_tokens = outcome.prompt_tokens
        state.prompt_chars = turn.prompt_size.chars
        state.last_turn_end = time.monotonic()
        tool = turn.next_tool or (outcome.tool_names[0] if outcome.tool_names else None)
        state.pending_tool = tool if (tool or outcome.finish_reason == "tool_calls") else None
        state.predicted_gap_s = None
        state.prefetch_fired_at = None
        if turn.session_id and self.kvindex is not None:
            # the pods the turn ran on, which a pin reaches before their residency reports
            # name the turn's chunks; a pod given by URL (--prefill) has no name the kvindex
            # could reach it by
            pods = [p for p in dict.fromkeys((state.last_pod, state.last_decode_pod))
                    if p and _POD_NAME.fullmatch(p)]
            self._spawn(self._record_turn(turn, state, outcome, pods))
            if self.settings.tool_prefetch and (
                    state.pending_tool is not None or outcome.finish_reason == "tool_calls"
                    or turn.announce_next):
                self._schedule_tool_prefetch(turn, state)
        if turn.memory and turn.memory.close_session and turn.session_key:
            self.sessions.forget(turn.session_key)  # its last turn: the kvindex closes it too

    async def _record_turn(self, turn: Turn, state: SessionState, outcome: TurnOutcome,
                           pods: list[str]) -> None:
        """After the turn, in the background (the session's next turn comes after this one's
        answer and the agent's tool call): its chunk chain becomes the session's context in
        the kvindex, with the routing record (--shared-sessions) in the same call and the
        context-change eviction; then the agent_memory verbs, which thus find the session
        there from its first turn. A kvindex that fails it fails no turn."""
        assert self.kvindex is not None and turn.session_id is not None
        kv = self.kvindex.for_tenant(turn.tenant)
        route = state.route() if self.settings.shared_sessions else None
        chunks = outcome.chunk_hashes
        if chunks is None and (scheme := self.settings.prompt_hash_scheme) is not None:
            chunks = prompt_chunk_hashes(turn.endpoint, turn.body, scheme,
                                         self.settings.chunk_size)
        try:
            written = await kv.put_context(turn.session_id, SessionContext(
                chunk_hashes=chunks, route=route,
                evict_dropped=self.settings.context_change_evict))
            self._record_hook("context", True)
            if route is not None:
                self.metrics.shared_sessions.labels("write", "written").inc()
            if written.dropped:
                self.metrics.context_changes.inc()
        except (ServiceUnavailable, RequestRejected) as exc:
            self._record_hook("context", False)
            if route is not None:
                self.metrics.shared_sessions.labels("write", "failed").inc()
            log.warning("session_context_write_failed", error=str(exc))
        memory = turn.memory
        if memory is None and self._tool_pins(turn, state.pending_tool):
            # the answer called a tool the caller did not announce: pinned after the turn
            # (in the tiers the kvindex reaches; the pod's device cache took no pin with it)
            memory = AgentMemory(pin_ttl_s=self._pin_ttl(state.pending_tool))
        if memory:
            await memory_hooks.after_turn(kv, turn.session_id, memory,
                                          outcome.chunk_hashes, self._record_hook, pods)

    def _schedule_tool_prefetch(self, turn: Turn, state: SessionState) -> None:
        """Announce the session's next turn to its pod shortly before the tool's predicted
        return (``expected_in_s``): a pod whose scheduler predicts admissions moves the
        session's chunks to DRAM when the turn is predicted for its next step, any other pod
        at once; either holds them there (``hold_s``, --announce-hold) until the turn is due,
        as the pod's other turns would otherwise evict them before it arrives."""
        assert turn.session_key is not None
        state.predicted_gap_s = gap_s = self.tool_gaps.predict(state.pending_tool)
        delay = self.tool_gaps.prefetch_delay(state.pending_tool, self.settings.prefetch_lead_s)
        chunks = list(state.chunk_hashes)
        if not chunks:
            return

        async def fire() -> None:
            await asyncio.sleep(delay)
            state.prefetch_fired_at = time.monotonic()
            expected_in_s = round(max(0.0, gap_s - delay), 3)
            hold_s = self.settings.announce_hold_s
            found = await self._prefetch_counted(PrefetchRequest(
                chunk_hashes=chunks, pod=state.last_pod,
                lookup_id=f"tool-gap:{turn.session_id}", expected_in_s=expected_in_s,
                hold_s=round(expected_in_s + hold_s, 3) if hold_s > 0 else None),
                "tool_prefetch", self.metrics.tool_gap_chunks)
            if found is not None:
                state.kv_at_announce = found

        key = turn.session_key
        old = self._prefetch_tasks.pop(key, None)
        if old is not None:
            old.cancel()
        task = self._prefetch_tasks[key] = self._spawn(fire())
        # a session that never comes back must not keep its entry: it goes with its task
        task.add_done_callback(lambda t: self._prefetch_tasks.pop(key, None)
                               if self._prefetch_tasks.get(key) is t else None)

    def _on_arrival(self, turn: Turn, state: SessionState) -> None:
        """Score the tool-gap prediction of the previous turn against this arrival, and say
        where the announce found the session's KV."""
        if turn.session_key is not None:
            task = self._prefetch_tasks.pop(turn.session_key, None)
            if task is not None and not task.done():
                task.cancel()
        if state.kv_at_announce is not None:
            turn.headers[H_AT_ANNOUNCE] = at_announce_header(state.kv_at_announce)
            state.kv_at_announce = None
        if state.last_turn_end is None or state.pending_tool is None and \
                state.predicted_gap_s is None:
            return
        actual = time.monotonic() - state.last_turn_end
        if state.predicted_gap_s is not None:
            self.metrics.tool_gap_error.observe(abs(actual - state.predicted_gap_s))
            warm = state.prefetch_fired_at is not None
            self.metrics.tool_gap_warm.labels("warm" if warm else "cold").inc()
        self.tool_gaps.observe(state.pending_tool, actual)

    async def _fork(self, turn: Turn, state: SessionState) -> None:
        """A branch starts where its parent is (``SessionState.fork_from``, which the
        simulator runs too), and the kvindex copies the parent's session record."""
        parent_key = session_key(turn.tenant, turn.parent_session_id)
        parent = self.sessions.peek(parent_key) if parent_key else None
        if parent is not None:
            state.fork_from(parent)
        if self.kvindex is not None and turn.session_id:
            try:
                await self.kvindex.for_tenant(turn.tenant).fork(turn.parent_session_id,
                                                               turn.session_id)
                self._record_hook("fork", True)
            except (ServiceUnavailable, RequestRejected):
                self._record_hook("fork", False)

    # ------------------------------------------------------------------ shared sessions
    def _shares(self, turn: Turn) -> KvindexClient | None:
        """The kvindex client acting for the turn's tenant, when --shared-sessions keeps its
        session's routing record there."""
        if not self.settings.shared_sessions or self.kvindex is None or not turn.session_id:
            return None
        return self.kvindex.for_tenant(turn.tenant)

    async def _adopt_shared_route(self, turn: Turn, state: SessionState) -> None:
        """Take the kvindex's record of the session's last turn when it is newer than what
        this replica saw (another replica served it, or this one restarted since). Without
        it (kvindex down, never written) the turn routes on what this replica knows."""
        kv = self._shares(turn)
        if kv is None:
            return
        try:
            route = await kv.get_route(turn.session_id)  # type: ignore[arg-type]
        except NotFound:
            self.metrics.shared_sessions.labels("read", "missing").inc()
            return
        except (ServiceUnavailable, RequestRejected) as exc:
            self.metrics.shared_sessions.labels("read", "failed").inc()
            log.warning("shared_session_read_failed", error=str(exc))
            return
        if route.turns <= state.turns:
            self.metrics.shared_sessions.labels("read", "current").inc()
            return
        self.metrics.shared_sessions.labels("read", "adopted").inc()
        state.adopt(route)

    def _record_hook(self, op: str, ok: bool) -> None:
        self.metrics.memory_hooks.labels(op, str(ok).lower()).inc()

    def _spawn(self, coro) -> asyncio.Task:  # type: ignore[no-untyped-def]
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def aclose(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)


def untried(attempts: list[Attempt], failed: set[str]) -> Iterator[Attempt]:
    """The attempts left once a pod has failed this turn: none of them asks that pod again
    (``failed`` grows as the caller's attempts fail)."""
    for prefill, decode in attempts:
        if prefill.name not in failed and (decode is None or decode.name not in failed):
            yield prefill, decode


def _json_or_error(content: bytes) -> dict[str, Any]:
    try:
        payload = json.loads(content)
        if isinstance(payload, dict):
            return payload
    except ValueError:
        pass
    return {"error": {"message": content.decode(errors="replace")[:500], "type": "upstream_error"}}


def _sse_error(message: str, code: str = "mid_stream_failure") -> bytes:
    body = {"error": {"message": message, "type": "upstream_error", "code": code}}
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()
