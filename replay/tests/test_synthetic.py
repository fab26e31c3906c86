"""The synthetic session generator: determinism and the stated distributions."""

from __future__ import annotations

import statistics

import pytest

from agentserving.replay.synthetic import (
    LogNormal,
    agent_preset,
    bench_small_preset,
    generate,
    generate_preset,
)
from agentserving.replay.trace import dump_lines, resolve_all


def _text(trace) -> str:
    return "\n".join(dump_lines(trace))


def test_same_seed_same_bytes_other_seed_other_trace():
    assert _text(generate_preset("bench-small")) == _text(generate_preset("bench-small"))
    assert _text(generate_preset("bench-small", seed=8)) != _text(generate_preset("bench-small"))


def test_more_sessions_keep_the_first_ones():
    small = generate(agent_preset(sessions=5, seed=3))
    big = generate(agent_preset(sessions=12, seed=3))
    roots_small = [s for s in small.sessions]
    assert big.sessions[: len(roots_small)] == roots_small


def test_bench_small_fits_the_cpu_budget():
    trace = generate_preset("bench-small")
    turns = [t for rs in resolve_all(trace) for t in rs.turns]
    assert 12 <= len([s for s in trace.sessions if s.parent is None]) <= 24
    assert 50 <= len(turns) <= 150
    assert max(len(t.prompt) for t in turns) <= 4096
    assert all(8 <= len(t.forced_output) <= 32 for t in turns)
    assert all(t.tool_gap_s <= 2.0 for t in turns)
    assert any(s.parent is not None for s in trace.sessions)  # branches are exercised
    assert trace.header.block_size == 256
    for s in trace.sessions:
        assert s.turns[-1].tool is None and s.turns[-1].tool_gap_s == 0
        assert all(t.tool for t in s.turns[:-1])
    # sessions of one agent kind share their system prompt blocks
    coder = [s for s in trace.sessions if s.meta.get("agent") == "coder" and s.parent is None]
    assert len(coder) >= 2
    assert coder[0].turns[0].input.block_ids == coder[1].turns[0].input.block_ids


def test_agent_preset_matches_its_sources():
    cfg = agent_preset(sessions=1500, seed=1)
    trace = generate(cfg)
    roots = [s for s in trace.sessions if s.parent is None]
    turns = [len(s.turns) for s in roots]
    outs = [t.num_output_tokens() for s in trace.sessions for t in s.turns]
    # seed 003: 12,740 turns / 1,999 trajectories = 6.37; ~181 output tokens per turn
    assert statistics.mean(turns) == pytest.approx(6.37, rel=0.08)
    assert statistics.mean(outs) == pytest.approx(181, rel=0.08)
    branches = len(trace.sessions) - len(roots)
    assert 0.05 * len(roots) < branches < 0.15 * len(roots)
    # early turns read and search; late turns edit and run tests
    early = [s.turns[0].tool for s in roots if len(s.turns) >= 5]
    late = [s.turns[-2].tool for s in roots if len(s.turns) >= 5]
    read = ("read_file", "search")
    write = ("edit_file", "run_tests")
    assert sum(t in read for t in early) > 2 * sum(t in read for t in late)
    assert sum(t in write for t in late) > 2 * sum(t in write for t in early)
    # Poisson arrivals at the preset's rate
    starts = sorted(s.start_s for s in roots)
    assert len(roots) / starts[-1] == pytest.approx(cfg.arrival_rate, rel=0.1)


def test_lognormal_is_clamped_and_has_its_median():
    import random

    d = LogNormal(median=100, sigma=0.5, lo=50, hi=160)
    rng = random.Random("x")
    xs = [d.sample(rng) for _ in range(4000)]
    assert min(xs) >= 50 and max(xs) <= 160
    assert statistics.median(xs) == pytest.approx(100, rel=0.05)


def test_bench_small_preset_is_what_the_generator_uses():
    assert generate(bench_small_preset()) == generate_preset("bench-small")
    with pytest.raises(ValueError, match="unknown preset"):
        generate_preset("nope")


def test_bench_agent_keeps_tracelab_token_ratios_within_the_cpu_budget():
    """The main job's workload: contexts ~23x the append (TraceLab's per-step means, scaled
    1/25) and outputs scaled 1/40; small enough for the tiny CPU model."""
    trace = generate_preset("bench-agent")
    assert _text(trace) == _text(generate_preset("bench-agent"))
    later = [t for rs in resolve_all(trace) for t in rs.turns if t.index > 0]
    ctx = statistics.mean(len(t.prompt) for t in later)
    append = statistics.median(t.appended for t in later)
    out = statistics.mean(len(t.forced_output) for t in later)
    assert 4000 <= ctx <= 7000  # TraceLab 147k cached prefix per step / 25 = 5.9k
    assert 15 <= ctx / append <= 35  # TraceLab: 147k / 6.6k = 22
    assert 300 <= ctx / out <= 600  # TraceLab: 147k / 523 = 281; outputs at /40, not /25
    turns = [t for rs in resolve_all(trace) for t in rs.turns]
    assert 60 <= len(turns) <= 100 and max(len(t.prompt) for t in turns) <= 8192
    assert sum(len(t.prompt) for t in turns) <= 520_000  # the baseline recomputes all of it
    # the first turn carries the run so far: no system has it cached
    first = [rs.turns[0] for rs in resolve_all(trace) if rs.session.parent is None]
    assert statistics.median(len(t.prompt) for t in first) >= 3500
