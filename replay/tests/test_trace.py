"""The session trace format: validation, round trip, resolution to tokens, ideal hit rate."""

from __future__ import annotations

import json

import pytest

from agentserving.replay.ideal import ideal_hit, planned_order
from agentserving.replay.tokens import FIRST_TOKEN_ID, block_tokens, unique_tokens
from agentserving.replay.trace import (
    Session,
    Trace,
    TraceFormatError,
    TraceHeader,
    read_trace,
    resolve_all,
    sessions_from,
    write_trace,
)


def _trace() -> Trace:
    return sessions_from([
        {"session_id": "a", "start_s": 0.0, "turns": [
            {"input": {"length": 40, "block_ids": ["sys/0", "sys/1"]}, "output_tokens": 5,
             "tool": "bash", "tool_gap_s": 0.5},
            {"input": {"length": 12}, "output_tokens": 3, "tool": "read_file",
             "tool_gap_s": 0.1},
            {"input": {"token_ids": [100, 101, 102]}, "output_token_ids": [7000, 7001]}]},
        {"session_id": "a.b0", "parent": {"session_id": "a", "turn": 0, "gap_s": 0.2},
         "turns": [{"input": {"length": 9}, "output_tokens": 4}]},
        {"session_id": "b", "start_s": 1.0, "turns": [
            {"input": {"length": 30, "block_ids": ["sys/0"]}, "output_tokens": 2}]},
    ], block_size=16, vocab_size=1000, source="test")


def test_tokens_are_fixed_forever():
    # Golden values: a change here changes every trace's tokens (and every stored run).
    assert block_tokens(0, 8, block_size=512) == [29085, 5790, 5997, 6245, 5659, 17407, 7636,
                                                  15961]
    assert unique_tokens("input/s0/1", 6) == [29770, 20764, 5091, 12117, 31291, 23336]
    # a trimmed block is a prefix of the whole block; int and str ids name the same block
    assert block_tokens(7, 100, block_size=512) == block_tokens("7", 512, block_size=512)[:100]
    toks = unique_tokens("x", 5000, vocab_size=50)
    assert min(toks) >= FIRST_TOKEN_ID and max(toks) < 50
    assert unique_tokens("x", 10) != unique_tokens("y", 10)


def test_resolution_follows_the_append_rule():
    sessions = {rs.session.session_id: rs for rs in resolve_all(_trace())}
    a = sessions["a"].turns
    sys_blocks = (block_tokens("sys/0", 16, block_size=16, vocab_size=1000)
                  + block_tokens("sys/1", 16, block_size=16, vocab_size=1000))
    assert a[0].prompt[:32] == sys_blocks and len(a[0].prompt) == 40
    assert a[1].prompt == a[0].prompt + a[0].forced_output + a[1].prompt[45:]
    assert len(a[1].prompt) == 40 + 5 + 12
    assert a[2].prompt == a[1].prompt + a[1].forced_output + [100, 101, 102]
    assert a[2].forced_output == [7000, 7001]
    assert all(len(t.forced_output) == n for t, n in zip(a, [5, 3, 2], strict=True))
    # the branch starts from the parent's context after turn 0 (prompt + output)
    b0 = sessions["a.b0"].turns[0]
    assert b0.prompt[:45] == a[0].prompt + a[0].forced_output and len(b0.prompt) == 54
    assert b0.prompt[45:] != a[1].prompt[45:54]  # its own new tokens
    # session b shares only the first system block with a
    b = sessions["b"].turns[0]
    assert b.prompt[:16] == a[0].prompt[:16] and b.prompt[16:32] != a[0].prompt[16:32]
    # resolution is deterministic
    again = {rs.session.session_id: rs for rs in resolve_all(_trace())}
    assert again["a"].turns[2].prompt == a[2].prompt


def test_replace_context_sends_only_the_input():
    trace = sessions_from([{"session_id": "m", "turns": [
        {"input": {"length": 20, "block_ids": [1, 2]}, "output_tokens": 3, "context": "replace"},
        {"input": {"length": 30, "block_ids": [1, 2]}, "output_tokens": 3,
         "context": "replace"}]}], block_size=16)
    t0, t1 = resolve_all(trace)[0].turns
    assert len(t1.prompt) == 30 and t1.prompt[:20] == t0.prompt


def test_round_trip(tmp_path):
    path = write_trace(_trace(), tmp_path / "t.jsonl")
    first = json.loads(path.read_text().splitlines()[0])
    assert first["header"]["format"] == "agentserving.sessions/v1"
    back = read_trace(path)
    assert back == _trace()
    assert back.header == TraceHeader(block_size=16, vocab_size=1000, source="test")


def assert_names_line(tmp_path, text: str, lineno: int, message: str) -> None:
    """Reading a trace file of ``text`` fails, naming the file, the line and ``message``."""
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(TraceFormatError) as err:
        read_trace(path)
    assert f"{path}:{lineno}:" in str(err.value) and message in str(err.value)


@pytest.mark.parametrize("line, message", [
    ('{"session_id": "x", "turns": []}', "at least 1"),
    ('{"session_id": "x", "turns": [{"input": {"length": 3, "token_ids": [1]}, '
     '"output_tokens": 1}]}', "exactly one of token_ids or length"),
    ('{"session_id": "x", "turns": [{"input": {"length": 3}}]}', "exactly one of output"),
    ('{"session_id": "x", "turns": [{"input": {"length": 3}, "output_tokens": 1, "tol": 1}]}',
     "tol"),
    ('[1, 2]', "JSON object"),
])
def test_bad_lines_are_named(tmp_path, line, message):
    assert_names_line(tmp_path, '{"header": {"block_size": 16}}\n' + line + "\n", 2, message)


def test_references_are_checked():
    turn = {"input": {"length": 4}, "output_tokens": 1}
    with pytest.raises(ValueError, match="duplicate session_id"):
        sessions_from([{"session_id": "a", "turns": [turn]}, {"session_id": "a", "turns": [turn]}])
    with pytest.raises(ValueError, match="must appear earlier"):
        sessions_from([{"session_id": "c", "parent": {"session_id": "a", "turn": 0},
                        "turns": [turn]}, {"session_id": "a", "turns": [turn]}])
    with pytest.raises(ValueError, match="out of range"):
        sessions_from([{"session_id": "a", "turns": [turn]},
                       {"session_id": "c", "parent": {"session_id": "a", "turn": 1},
                        "turns": [turn]}])
    with pytest.raises(ValueError, match="3 blocks of 16 for 20 tokens"):
        sessions_from([{"session_id": "a", "turns": [
            {"input": {"length": 20, "block_ids": [1, 2, 3]}, "output_tokens": 1}]}],
            block_size=16)


def test_limit_counts_root_sessions_and_keeps_their_branches():
    trace = _trace()
    assert [s.session_id for s in trace.limit(1).sessions] == ["a", "a.b0"]
    assert [s.session_id for s in trace.limit(2).sessions] == ["a", "a.b0", "b"]
    assert trace.limit(None) is trace


def test_planned_order_and_ideal_hit():
    sessions = resolve_all(_trace())
    order = [(t.session_id, t.index) for t in planned_order(sessions)]
    # a: turns at 0, 0.5, 0.6; the branch forks after a's turn 0 (t=0) + gap 0.2; b at 1.0
    assert order == [("a", 0), ("a.b0", 0), ("a", 1), ("a", 2), ("b", 0)]
    ideal = ideal_hit(sessions, chunk_size=16)
    # a0: nothing cached; a.b0: 2 chunks of a0 (prompt 40 + out 5 = 45 -> 2 full chunks; the
    # 54-token prompt may reuse up to 3): 32; a1 (57 tokens): 2 chunks of a0 = 32 (its third
    # chunk holds a1's own input); b0: the shared sys/0 block = 16; a2: a1's prompt+output
    # covers 59 tokens -> 3 chunks = 48.
    assert ideal.per_turn == {("a", 0): 0, ("a.b0", 0): 32, ("a", 1): 32, ("b", 0): 16,
                              ("a", 2): 48}
    total = sum(len(t.prompt) for rs in sessions for t in rs.turns)
    assert ideal.prompt_tokens == total
    assert ideal.hit_rate == pytest.approx(128 / total)
    # without outputs, a2 can only reuse a1's 57 prompt tokens: still 3 chunks; a.b0 keeps 2
    assert ideal_hit(sessions, chunk_size=16, include_outputs=False).reusable_tokens == 128


def test_one_token_is_always_recomputed():
    # a prompt that is exactly 2 chunks, repeated: the second can reuse only 1 chunk
    s = [{"session_id": f"s{i}", "turns": [{"input": {"length": 32, "block_ids": [1, 2]},
                                            "output_tokens": 1}]} for i in range(2)]
    ideal = ideal_hit(resolve_all(sessions_from(s, block_size=16)), chunk_size=16)
    assert ideal.per_turn[("s1", 0)] == 16


def test_session_model_defaults():
    s = Session.model_validate({"session_id": "x", "turns": [
        {"input": {"length": 3}, "output_tokens": 2, "timestamp_s": 4.0}]})
    assert s.planned_start_s() == 4.0 and s.turns[0].context == "append"


def test_parts_put_shared_blocks_after_a_turns_own_tokens():
    def session(sid: str) -> dict:
        return {"session_id": sid, "meta": {"source": "test"}, "turns": [
            {"input": {"parts": [{"length": 20, "block_ids": ["pre/0", "pre/1"]},
                                 {"length": 5}, {"length": 18, "block_ids": ["post/0", "post/1"]},
                                 {"token_ids": [900, 901]}]},
             "output_tokens": 2, "meta": {"usage": {"prompt_tokens": 70}}},
            {"input": {"length": 4}, "output_tokens": 1}]}

    trace = sessions_from([session("a"), session("b")], block_size=16, vocab_size=1000)
    a, b = (rs.turns for rs in resolve_all(trace))
    blocks = lambda *ids: [t for i in ids for t in block_tokens(i, 16, block_size=16,  # noqa: E731
                                                                 vocab_size=1000)]
    assert a[0].prompt[:20] == blocks("pre/0", "pre/1")[:20]
    assert a[0].prompt[25:43] == blocks("post/0", "post/1")[:18]
    assert a[0].prompt[43:] == [900, 901] and len(a[0].prompt) == 45
    # part j's own tokens are keyed input/{sid}/{k}/{j}: the same in every trace, other per
    # session; the shared text after them is the same tokens in both sessions
    assert a[0].prompt[20:25] == unique_tokens("input/a/0/1", 5, vocab_size=1000)
    assert a[0].prompt[20:25] != b[0].prompt[20:25] and a[0].prompt[25:] == b[0].prompt[25:]
    assert a[1].prompt == a[0].prompt + a[0].forced_output + unique_tokens("input/a/1", 4,
                                                                           vocab_size=1000)
    # ... yet a prefix cache reuses only what comes before the session's own tokens
    assert ideal_hit(resolve_all(trace), chunk_size=16).per_turn[("b", 0)] == 16
    assert trace.sessions[0].turns[0].input.num_tokens() == 45
    assert trace.sessions[0].turns[0].meta == {"usage": {"prompt_tokens": 70}}
    assert trace.sessions[0].meta["source"] == "test"


def test_parts_round_trip_and_old_forms_dump_as_before(tmp_path):
    trace = sessions_from([{"session_id": "a", "turns": [
        {"input": {"parts": [{"length": 3}, {"token_ids": [17]}]}, "output_tokens": 1,
         "meta": {"k": 1}}]}], block_size=16)
    path = write_trace(trace, tmp_path / "p.jsonl")
    assert read_trace(path) == trace
    line = json.loads(path.read_text().splitlines()[1])
    assert line["turns"][0]["input"] == {"parts": [{"length": 3}, {"token_ids": [17]}]}
    old = write_trace(_trace(), tmp_path / "old.jsonl").read_text()
    assert '"meta"' not in old and '"parts"' not in old


@pytest.mark.parametrize("inp, message", [
    ('{"parts": []}', "at least 1"),
    ('{"parts": [{"length": 2}], "length": 2}', "exactly one of token_ids or length or parts"),
    ('{"parts": [{"length": 2, "token_ids": [20]}]}', "parts.0"),
    ('{"parts": [{"length": 2}, {"token_ids": [-1]}]}', "parts.1"),
    ('{"parts": [{"parts": [{"length": 1}]}]}', "parts.0.parts"),
])
def test_bad_parts_are_named(tmp_path, inp, message):
    assert_names_line(tmp_path, '{"session_id": "x", "turns": [{"input": ' + inp
                      + ', "output_tokens": 1}]}\n', 1, message)


def test_too_many_blocks_in_a_part_names_the_part():
    with pytest.raises(ValueError, match=r"turns\[0\]\.input\.parts\[1\]: 3 blocks of 16"):
        sessions_from([{"session_id": "a", "turns": [{"input": {"parts": [
            {"length": 4}, {"length": 20, "block_ids": [1, 2, 3]}]}, "output_tokens": 1}]}],
            block_size=16)
