"""A conversation's calls in a model's tokens: the append rule, shared pieces, clamping."""

from __future__ import annotations

from agentserving.engine.model.tokenizer import ByteTokenizer
from agentserving.replay.importers.templated import (
    Call,
    Piece,
    count_calls,
    renders_tool_calls,
    text_digest,
)

TINY = ByteTokenizer(32000)
SYS = {"role": "system", "content": "shared rules"}


def _len(messages) -> int:
    return len(TINY.prompt_ids(TINY.render_chat(messages, add_generation_prompt=True)))


def test_inputs_make_every_prompt_its_templated_length():
    q1, q2 = {"role": "user", "content": "TASK one"}, {"role": "tool", "content": "out"}
    calls = [Call([SYS, q1], "ok", shared_until="shared rules", shared_from=" one"),
             Call([SYS, q1, {"role": "assistant", "content": "ok"}, q2], "done")]
    first, second = count_calls(TINY, calls).calls
    assert first.prompt_tokens == _len([SYS, q1]) and first.output_tokens == 3  # "ok" + end
    head = TINY.prompt_ids("<s><|system|>shared rules")
    tail = " one<|end|><|assistant|>"
    assert first.pieces == [Piece(len(head), text_digest("<s><|system|>shared rules")),
                            Piece(len(TINY.prompt_ids("<|end|><|user|>TASK"))),
                            Piece(len(TINY.prompt_ids(tail)), text_digest(tail))]
    assert first.input_tokens == first.prompt_tokens
    assert second.prompt_tokens == _len(calls[1].messages)
    assert second.pieces == [Piece(second.prompt_tokens - first.prompt_tokens - 3)]


def test_a_prompt_that_does_not_extend_the_last_is_clamped_or_replaced():
    q = {"role": "user", "content": "a long question " * 4}
    calls = [Call([SYS, q], "x" * 50), Call([{"role": "user", "content": "short"}], "y")]
    counted = count_calls(TINY, calls)
    assert counted.clamped == 1 and counted.calls[1].pieces == [Piece(0)]
    replaced = count_calls(TINY, [calls[0], Call(calls[1].messages, "y", replace=True)])
    assert replaced.clamped == 0
    assert replaced.calls[1].input_tokens == replaced.calls[1].prompt_tokens


def test_the_tiny_template_renders_no_tool_calls():
    assert renders_tool_calls(TINY) is False
