"""`agentserving trace agent-pressure` and the bundled `agent-pressure` workload."""

from __future__ import annotations

import random
import statistics

import pytest
from click.testing import CliRunner

from agentserving.core.cli import main
from agentserving.replay.importers.agent_pressure import AGENTIC, HUMAN, contexts, working_set
from agentserving.replay.loader import WORKLOADS, load_trace
from agentserving.replay.tests.workload_fixtures import step, trajectory, write_tree
from agentserving.replay.trace import read_trace, resolve_all


def _runs(tmp_path, n: int = 12):
    """``n`` five-call trajectories of one set."""
    files = {}
    for i in range(n):
        steps = [step(f"Step {k} of task {i}.", f"cat file_{k}.py",
                      [(f"line {k}\n" * (20 + 7 * i), 0.5)]) for k in range(5)]
        files[f"out/setA/p__p-{i}/p__p-{i}.traj.json"] = trajectory(
            f"p__p-{i}", f"Task {i}: the parser fails on input {i}.", steps, t0=1000.0 + i)
    return write_tree(tmp_path / "runs", files)


def _build(tmp_path, *args: str):
    out = tmp_path / f"pressure-{len(list(tmp_path.glob('pressure-*')))}.jsonl"
    res = CliRunner().invoke(main, ["trace", "agent-pressure", "--swe", str(_runs(tmp_path)),
                                    "--model", "tiny", "--out", str(out), *args])
    assert res.exit_code == 0, res.output
    return read_trace(out)


@pytest.mark.parametrize("kind", [AGENTIC, HUMAN])
def test_pauses_have_the_published_median_and_mean(kind):
    rng = random.Random(3)
    draws = [kind.draw(rng) for _ in range(40_000)]
    assert statistics.median(draws) == pytest.approx(kind.median_s, rel=0.05)
    # the cap takes a little off the log-normal's mean
    assert kind.mean_s * 0.85 < statistics.fmean(draws) <= kind.mean_s * 1.02
    assert max(draws) <= kind.max_s


def test_sessions_pause_fork_and_reset_as_asked(tmp_path):
    trace = _build(tmp_path, "--sessions", "4", "--fork-share", "1", "--reset-share", "1",
                   "--time-scale", "1", "--seed", "5")
    gen = trace.header.generator
    roots = [s for s in trace.sessions if s.parent is None]
    subs = [s for s in trace.sessions if s.parent is not None]
    assert len(roots) == gen["roots"] == 4 and gen["forking_roots"] == 4 and gen["resets"] == 4
    assert len(subs) == gen["subagents"] and 4 * 2 <= len(subs) <= 4 * 8
    assert max(r.start_s for r in roots) < 10  # they arrive together
    pauses = {"agentic": 0, "human": 0}
    for s in trace.sessions:
        assert "pause" not in s.turns[0].meta and s.turns[-1].tool_gap_s == 0.0
        for before, turn in zip(s.turns[:-1], s.turns[1:], strict=True):
            kind = turn.meta["pause"]
            pauses[kind] += 1
            assert 0 < before.tool_gap_s <= (AGENTIC if kind == "agentic" else HUMAN).max_s
    assert pauses == gen["pauses"]["drawn"] and pauses["human"] > 0 < pauses["agentic"]
    resolved = {r.session.session_id: r for r in resolve_all(trace)}
    for root in roots:  # one reset each: the first prompt again, then a summary
        [k] = [k for k, t in enumerate(root.turns) if t.meta.get("reset")]
        assert k >= 2 and root.turns[k].context == "replace"
        first, reset = resolved[root.session_id].turns[0].prompt, \
            resolved[root.session_id].turns[k].prompt
        assert reset[:len(first)] == first and len(reset) > len(first)
        before = contexts(root.turns)[k - 1] + root.turns[k - 1].output_tokens
        assert len(reset) - len(first) >= before // 10  # a tenth of the context, summarised
    for sub in subs:  # a subagent starts from its parent's context, then its own task
        parent = resolved[sub.parent.session_id]
        at = sub.parent.turn
        context = parent.turns[at].prompt + parent.turns[at].forced_output
        prompt = resolved[sub.session_id].turns[0].prompt
        assert prompt[:len(context)] == context
        assert len(prompt) == len(context) + 200  # --fork-task-tokens
        assert sub.meta["subagent_of"] == sub.parent.session_id
    assert gen["working_set_tokens"] == working_set(trace.sessions)


def test_the_same_seed_gives_the_same_workload_and_another_seed_another(tmp_path):
    a, b = _build(tmp_path, "--sessions", "3"), _build(tmp_path, "--sessions", "3")
    c = _build(tmp_path, "--sessions", "3", "--seed", "9")
    assert a.sessions == b.sessions and a.sessions != c.sessions


def test_bad_branch_counts_name_the_flag(tmp_path):
    res = CliRunner().invoke(main, ["trace", "agent-pressure", "--swe", str(_runs(tmp_path)),
                                    "--model", "tiny", "--fork-min-branches", "5",
                                    "--fork-max-branches", "2", "--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and "--fork-min-branches" in res.output


def test_the_bundled_pressure_workload_strains_a_fleets_dram():
    trace = load_trace("bundled:agent-pressure")
    assert (WORKLOADS / "agent-pressure.jsonl").is_file()
    gen = trace.header.generator
    roots = [s for s in trace.sessions if s.parent is None]
    assert len(roots) == gen["roots"] == 48 and gen["subagents"] > 0
    assert gen["command"].startswith("agentserving trace agent-pressure ")
    assert max(r.start_s for r in roots) < 30  # dozens per pod at once
    # every pause kind drawn, in the published shares
    drawn = gen["pauses"]["drawn"]
    assert 0.2 < drawn["human"] / (drawn["human"] + drawn["agentic"]) < 0.4
    assert gen["working_set_tokens"] == working_set(trace.sessions)
    # the main job's fleet: 3 pods of 2 GiB of DRAM; this working set is over 3x a third of
    # that, so the bench's DRAM per pod is at most fleet_dram_gib_at_most / 3
    assert gen["fleet_dram_gib_at_most"] * 3 == pytest.approx(gen["working_set_gib"], rel=1e-3)
