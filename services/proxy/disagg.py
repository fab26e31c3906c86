"""Conditional disaggregation: when a turn skips the prefill pod.

An agent turn appends a few hundred tokens to a context of thousands. After the session's
previous turn its decode pod holds that context (it pulled the prompt's KV and keeps the full
chunks in its tiers), so computing the new tokens there costs one short prefill. Sending the
turn through a prefill pod instead costs a place in that pod's queue (behind other sessions'
long first turns), the hand-off of the whole prompt's new KV, and the decode pod's pull. Past a
size the trade flips: a long prefill on a decode pod stalls the requests decoding there. So the
proxy disaggregates only when the decode pod would compute more than ``threshold`` tokens —
the rule llm-d's P/D threshold and Dynamo's conditional disaggregation apply.

Pure: the proxy hands in what it knows (the prompt's size, what the session's previous turn
left on its decode pod, the ranked candidates) and gets a plan (``plan_local_pod``); the
cluster simulator (sim/cluster.py) calls the same planner, so the two cannot drift. The proxy
never tokenizes: a token-id prompt has an exact length; a text prompt is sized by the session's
own tokens per character, learned from the previous turn's usage. Anything it cannot size goes
through the prefill pod.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from agentserving.proxy.routing import Candidate, queued_work


@dataclass(frozen=True)
class PromptSize:
    tokens: int | None  # exact, for a prompt given as token ids
    chars: int | None  # for a text prompt or chat messages; None: cannot be sized


@dataclass(frozen=True)
class HeldContext:
    """What a session's previous turn left on the decode pod that served it."""

    prompt_tokens: int  # that turn's prompt length, from its usage
    prompt_chars: int | None  # that turn's prompt size in characters (text prompts)
    chunk_size: int

    @property
    def held_tokens(self) -> int:
        """Only full chunks are kept in the tiers; the trailing partial one is recomputed."""
        return self.prompt_tokens // self.chunk_size * self.chunk_size


def prompt_size(endpoint: str, body: Mapping[str, Any]) -> PromptSize:
    """The size of one request's prompt, as far as it can be known without a tokenizer."""
    if endpoint.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list):
            return PromptSize(None, None)
        total = 0
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                total += len(content)
            elif isinstance(content, list):
                total += sum(len(p.get("text") or "") for p in content if isinstance(p, dict))
        return PromptSize(None, total)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return PromptSize(None, len(prompt))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return PromptSize(len(prompt), None)
    return PromptSize(None, None)  # a batch of prompts, or nothing to size


def local_prefill_tokens(size: PromptSize, held: HeldContext) -> int | None:
    """Prompt tokens the decode pod would compute for this turn; None when unknown (or when the
    prompt does not look like the previous one extended)."""
    if size.tokens is not None:
        tokens = size.tokens
    elif size.chars is not None and held.prompt_chars:
        tokens = round(size.chars * held.prompt_tokens / held.prompt_chars)
    else:
        return None
    if tokens < held.prompt_tokens:  # shorter than last turn: not an extension (compaction?)
        return None
    return tokens - held.held_tokens


def prefill_on_decode_pod(size: PromptSize, held: HeldContext | None, threshold: int,
                          prefill_backlog: int = 0, max_prefill_backlog: int = 0,
                          remote_tokens: int | None = None) -> bool:
    """True when the turn should skip the prefill pod.

    - its decode pod holds the session's context and would compute at most ``threshold`` new
      prompt tokens;
    - or the prefill pod would compute at least ``threshold`` tokens more than the decode pod
      (``remote_tokens``, when the caller looked it up): it lacks context the decode pod
      computed itself on the session's earlier local turns;
    - or the prefill pool is saturated: its least-busy pod already has ``max_prefill_backlog``
      turns in flight (0: no limit), so waiting there would take longer than prefilling on a
      decode pod — Dynamo's prefill-queue rule.
    """
    if max_prefill_backlog > 0 and prefill_backlog >= max_prefill_backlog:
        return True
    if threshold <= 0 or held is None:
        return False
    n = local_prefill_tokens(size, held)
    if n is None:
        return False
    return n <= threshold or (remote_tokens is not None and remote_tokens - n >= threshold)


class _Unasked:
    def __repr__(self) -> str:
        return "UNASKED"


UNASKED: Final = _Unasked()  # the kvindex was not asked (None: asked, no answer)


@dataclass(frozen=True)
class Placement:
    """What conditional disaggregation reads for one routed turn."""

    size: PromptSize
    held: HeldContext | None  # what the session's previous turn left on its own pod
    own: Candidate | None  # the session's own pod (a decode pod, or a host), if it still serves
    prefill: Sequence[Candidate]  # ranked by the routing policy
    decode: Sequence[Candidate]  # ranked by the decode policy
    hosts: Sequence[Candidate]  # prefill pods that may be a session's own pod
    threshold: int  # --local-prefill-tokens
    max_prefill_backlog: int
    balance_tokens: int = 0  # --balance-tokens (0: no balancing by queued work)
    turn_tokens: int = 2048  # what one turn in flight weighs in queued work (--load-penalty)

    def work(self, c: Candidate) -> int:
        return queued_work(c, self.turn_tokens)


@dataclass(frozen=True)
class LocalPlan:
    """Where the turn runs whole (``pod``; None: through P/D), or, with ``ask`` set, the
    question that decides it: how many prompt tokens the prefill pod ``ask`` would compute
    (``kvindex`` lookup of the session's chunks). Plan again with the answer."""

    pod: Candidate | None = None
    ask: str | None = None


def plan_local_pod(p: Placement, remote_tokens: int | None | _Unasked = UNASKED) -> LocalPlan:
    """Conditional disaggregation for one turn. The session's own pod is chosen even when
    another has fewer turns in flight: moving the session would cost a pull of its whole
    context. A long append needs the first-ranked prefill pod's share of the context (after
    local turns it may lack what the decode pod computed): the plan asks for it, once. A turn
    with no pod of its own runs on the first-ranked decode pod when the prefill pool is
    saturated, or whole on an idle prefill pod that hosts sessions (``idle_host``). With
    ``balance_tokens`` the queued work decides too (``first_turn_pod``, ``spill_pod``)."""
    backlog = min((c.inflight for c in p.prefill), default=0)
    asked: str | None = None  # the pod ``remote_tokens`` is about

    def decide(remote: int | None = None) -> bool:
        return prefill_on_decode_pod(p.size, p.held, p.threshold, backlog,
                                     p.max_prefill_backlog, remote)

    local = decide()
    if not local and p.held is not None and p.prefill and p.size.tokens is not None:
        if isinstance(remote_tokens, _Unasked):
            return LocalPlan(ask=p.prefill[0].name)
        asked = p.prefill[0].name
        local = remote_tokens is not None and decide(remote_tokens)
    if not local and p.own is None:
        return LocalPlan(first_turn_pod(p) or idle_host(p.hosts, p.decode))
    if not local or not p.decode:
        return LocalPlan()
    own = p.own or p.decode[0]
    if p.own is None or p.balance_tokens <= 0:
        return LocalPlan(own)
    alt = spill_pod(p)
    if alt is None:
        return LocalPlan(own)
    if asked is None:
        if isinstance(remote_tokens, _Unasked):
            return LocalPlan(ask=alt.name)
        asked = alt.name
    lacks = remote_tokens if asked == alt.name and isinstance(remote_tokens, int) else None
    if lacks is not None and p.work(alt) + lacks + p.balance_tokens < own_cost(p):
        return LocalPlan(alt)
    return LocalPlan(own)


def own_cost(p: Placement) -> int:
    """The work ahead of this turn's first token on the session's own pod: what is queued
    there, and the new tokens it computes."""
    assert p.own is not None and p.held is not None
    return p.work(p.own) + (local_prefill_tokens(p.size, p.held) or 0)


def spill_pod(p: Placement) -> Candidate | None:
    """The pod a session's turn may move to, its own pod being backed up: the one with the
    least queued work among the other decode pods and the prefill pods that host sessions,
    when the backlog is worth a question (moving there beats staying even if that pod lacked
    nothing of the context). Whether it does is settled by how much of the context it lacks
    (the kvindex's answer): a session that ran its first turn through the prefill pod finds
    most of its context there. It answers one queue behind another's long prefill while a
    pod idles (on the agent mix, one decode pod's turns waited twice as long as the other's
    while the prefill pod idled); on hosts whose pods share the cores, an idle pod is not
    idle capacity, and it does not pay there (docs/replay.md)."""
    if p.own is None or p.held is None or p.size.tokens is None:
        return None
    others = [c for c in (*p.hosts, *p.decode) if c.name != p.own.name]
    if not others:
        return None
    alt = min(others, key=p.work)
    return alt if p.work(alt) + p.balance_tokens < own_cost(p) else None


def first_turn_pod(p: Placement) -> Candidate | None:
    """A turn with no pod of its own, by queued work: whole on the first-ranked decode pod
    when it has less work queued than the first-ranked prefill pod; whole on that prefill pod
    (which then hosts the session) when the decode pod has any; P/D (None) when it has none.
    The prefill pod's queue is one more pod's capacity for cold work, not a fixed quota of it
    (with ``max_prefill_backlog`` 1, every cold turn that finds it computing anything goes to
    a decode pod). And a P/D turn's decode stage queues on its decode pod behind that pod's
    own prefills: on cold bursts (the Mooncake sample) P/D turns waited seconds for their first
    token where turns run whole on the prefill pod waited tenths."""
    if p.balance_tokens <= 0 or not p.prefill or not p.decode:
        return None
    decode, prefill = p.decode[0], p.prefill[0]
    if p.work(decode) < p.work(prefill):
        return decode
    if p.work(decode) > 0 and any(h.name == prefill.name for h in p.hosts):
        return prefill
    return None


def idle_host(hosts: Sequence[Candidate], decode: Sequence[Candidate]) -> Candidate | None:
    """A turn with no pod of its own, about to go P/D: when every decode pod is busy and the
    first-ranked host idle, that pod runs it whole and keeps the session. P/D would prefill
    there anyway, then hand the context to a busy decode pod whose queue the session's
    appends would join, and the prefill pod's idle time serves no session (on bench-agent the
    decode pods served 88 of 89 turns)."""
    if hosts and hosts[0].inflight == 0 and all(d.inflight > 0 for d in decode):
        return hosts[0]
    return None
