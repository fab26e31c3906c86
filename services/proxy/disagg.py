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
left on its decode pod) and gets the decision. The proxy never tokenizes: a token-id prompt has
an exact length; a text prompt is sized by the session's own tokens per character, learned from
the previous turn's usage. Anything it cannot size goes through the prefill pod.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


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
