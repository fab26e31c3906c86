"""Is a real conversation prefix-stable in a model's chat template, and where does it break?

The replay (and every prefix cache) assumes that a turn's prompt, as token ids, starts with
the previous turn's prompt followed by the previous output as the model emitted it:

    ids(prompt[k]) starts with ids(prompt[k-1]) + ids(reply[k-1]) + [end of turn]

where the reply is tokenized on its own, as a model emits it. A real template and tokenizer
can break that. ``check_turn`` says whether one turn keeps it and, if not, why, by finding
where the texts differ first (and, if they do not, where the tokens do):

- ``tool call dropped``: the template renders no tool calls, so the call the model emitted
  is not in the next prompt;
- ``earlier turns re-rendered``: the new prompt's text differs inside the previous prompt
  (a template that renders a message depending on what follows it);
- ``whitespace stripped``: the template trims the reply (the difference is whitespace);
- ``reply rendered differently``: any other change to the reply's text;
- ``end of turn differs``: the template closes the reply with other text than its end token;
- ``BPE merge at the reply's start``: equal texts, but the reply's first characters merge
  with the generation prompt before them into other tokens;
- ``BPE merge inside the reply``: equal texts, tokens differ later in the reply.

``bench/prefix_stability_bench.py`` runs it over the mini-swe-agent runs.
"""

from __future__ import annotations

from collections.abc import Sequence

STABLE = "stable"
BREAKS = ("tool call dropped", "earlier turns re-rendered", "whitespace stripped",
          "reply rendered differently", "end of turn differs", "BPE merge at the reply's start",
          "BPE merge inside the reply")
SEAM_TOKENS = 2  # a token mismatch this close to the reply's start is a merge across the seam


def first_difference(a: Sequence[object], b: Sequence[object]) -> int | None:
    """The first index where ``a`` and ``b`` differ (one ending first counts), else None."""
    n = min(len(a), len(b))
    if a[:n] != b[:n]:
        lo, hi = 0, n  # the first differing index lies in [lo, hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if a[lo:mid] != b[lo:mid]:
                hi = mid
            else:
                lo = mid
        return lo
    return None if len(a) == len(b) else n


def check_turn(*, prev_text: str, prev_ids: Sequence[int], reply: str, call_at: int | None,
               end: str, out_ids: Sequence[int], text: str, ids: Sequence[int]) -> str:
    """``STABLE`` or the first break (``BREAKS``) between the previous turn and this one.

    ``reply``: the previous turn's reply as emitted, ``call_at`` where its tool-call text
    starts (None: it has none), ``end`` the end-of-turn token's text, ``out_ids`` the ids of
    reply + end tokenized on their own; ``text``/``ids``: this turn's prompt."""
    expected = list(prev_ids) + list(out_ids)
    if len(ids) >= len(expected) and first_difference(ids[:len(expected)], expected) is None:
        return STABLE
    want = prev_text + reply + end
    c = first_difference(text[:len(want)], want)
    if c is None:  # the same text, other tokens
        p = first_difference(ids[:len(expected)], expected) or 0
        return BREAKS[5] if p < len(prev_ids) + SEAM_TOKENS else BREAKS[6]
    if c < len(prev_text):
        return BREAKS[1]
    at = c - len(prev_text)
    if at >= len(reply):
        return BREAKS[4]
    if call_at is not None and at >= call_at and reply[call_at:] not in text[len(prev_text):]:
        return BREAKS[0]
    if want[c].isspace() or (c < len(text) and text[c].isspace()):
        return BREAKS[2]
    return BREAKS[3]
