"""A conversation's model calls as the serving model's token counts.

An OpenAI-compatible server renders the messages of every call through the model's chat
template and tokenizes the text. So a call's prompt is counted as exactly that: the template's
text (``Tokenizer.render_chat``, with the tools the client declared) in the model's tokens. Its
output is the assistant's text as the model emits it, tokenized on its own, plus the
end-of-turn token. What a later call appends is then what makes the counts add up,

    input[k+1] = prompt[k+1] - prompt[k] - output[k]

so the trace's append rule (``agentserving.replay.trace``) reproduces every prompt's real
length. Where the template is not prefix-stable (it re-renders earlier turns, or BPE merges
across a seam) the replayed tokens differ from what a real client would send but the lengths
stay right; ``bench/prefix_stability_bench.py`` measures how often that happens.

Counting every call's whole prompt would tokenize a 100-call conversation's text 100 times;
``PromptCounter`` tokenizes each piece between special tokens once and gives the same counts.

Shared text (a system prompt, instructions every task carries) is marked per call by text the
prompt contains: everything up to the end of ``shared_until`` (its first occurrence), and
everything from the start of ``shared_from`` (its last occurrence). Such a piece is named by a
digest of its text, so the same text in two sessions becomes the same blocks and other text
does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import blake3

from agentserving.engine.model.tokenizer import PromptCounter, Tokenizer


@dataclass(frozen=True)
class Piece:
    """A run of what a turn appends: shared text (``shared`` is its digest) or its own."""

    tokens: int
    shared: str | None = None


@dataclass(frozen=True)
class Call:
    """One model call: the messages sent and the reply the model gave."""

    messages: Sequence[dict[str, Any]]
    reply: str  # the assistant's text as the model emits it, without the end-of-turn token
    replace: bool = False  # this prompt does not extend the previous call's
    shared_until: str | None = None
    shared_from: str | None = None


@dataclass(frozen=True)
class CountedCall:
    pieces: list[Piece]  # what this call appends (its whole prompt when it is the first/replace)
    prompt_tokens: int
    output_tokens: int

    @property
    def input_tokens(self) -> int:
        return sum(p.tokens for p in self.pieces)


@dataclass
class Counting:
    """The counts of one conversation, and how often the append rule had to give way."""

    calls: list[CountedCall] = field(default_factory=list)
    # calls whose prompt was shorter than the previous prompt + output (a template that
    # re-renders history): their input is clamped at 0, and the header counts them
    clamped: int = 0


def text_digest(text: str) -> str:
    return blake3.blake3(text.encode()).hexdigest()[:16]


def count_calls(tokenizer: Tokenizer, calls: Sequence[Call], *,
                tools: list[dict[str, Any]] | None = None) -> Counting:
    """Every call's prompt, input pieces and output in ``tokenizer``'s tokens."""
    counter = PromptCounter(tokenizer)
    end = tokenizer.end_of_turn
    out = Counting()
    previous: CountedCall | None = None
    for call in calls:
        text = tokenizer.render_chat(list(call.messages), add_generation_prompt=True,
                                     tools=tools)
        prompt = counter.count_prompt(text)
        output = counter.count(call.reply + end)
        if previous is None or call.replace:
            pieces = _split_shared(counter, text, prompt, call)
        else:
            appended = prompt - previous.prompt_tokens - previous.output_tokens
            if appended < 0:
                out.clamped += 1
            pieces = [Piece(max(0, appended))]
        previous = CountedCall(pieces, prompt, output)
        out.calls.append(previous)
    return out


def _split_shared(counter: PromptCounter, text: str, prompt: int, call: Call) -> list[Piece]:
    start, stop = 0, len(text)
    if call.shared_until and (i := text.find(call.shared_until)) >= 0:
        start = i + len(call.shared_until)
    if call.shared_from and (j := text.rfind(call.shared_from)) >= start:
        stop = j
    head = [Piece(counter.count(text[:start]), text_digest(text[:start]))] if start else []
    tail = [Piece(counter.count(text[stop:]), text_digest(text[stop:]))] if stop < len(text) \
        else []
    # the own piece takes whatever the seams gained or lost: the prompt's length is exact
    own = prompt - sum(p.tokens for p in head + tail)
    return [*head, Piece(max(0, own)), *tail]


def renders_tool_calls(tokenizer: Tokenizer) -> bool:
    """Whether the chat template writes an assistant message's tool calls into the prompt
    (rendered with and without one, the text differs)."""
    call = {"type": "function", "id": "call_0",
            "function": {"name": "agentserving_probe", "arguments": {"command": "probe"}}}
    base = [{"role": "user", "content": "q"}]
    try:
        with_call = tokenizer.render_chat(
            [*base, {"role": "assistant", "content": "a", "tool_calls": [call]}],
            add_generation_prompt=False)
    except Exception:  # noqa: BLE001 - a template that chokes on tool calls renders none
        return False
    without = tokenizer.render_chat([*base, {"role": "assistant", "content": "a"}],
                                    add_generation_prompt=False)
    return with_call != without
