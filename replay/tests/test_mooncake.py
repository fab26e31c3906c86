"""The Mooncake reader: session grouping, block expansion, scaling, and the real trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentserving.replay.ideal import ideal_hit
from agentserving.replay.loader import detect_format, load_trace
from agentserving.replay.mooncake import MooncakeOptions, read_mooncake
from agentserving.replay.tokens import block_tokens
from agentserving.replay.trace import TraceFormatError, resolve_all

REAL = Path(__file__).resolve().parents[3] / "shared/data/mooncake/conversation_trace.jsonl"


def _write(tmp_path, rows) -> Path:
    path = tmp_path / "mc.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [
    # conversation A: r0 -> r2 -> r4 (each shares >= 2 blocks with the previous)
    {"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [0, 1, 2]},
    # a different conversation that shares only the global block 0
    {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 9]},
    {"timestamp": 1500, "input_length": 1600, "output_length": 7, "hash_ids": [0, 1, 3, 4]},
    # extends r0 (full blocks [0, 1]) but diverges inside r2: a branch from r0's turn
    {"timestamp": 2000, "input_length": 1300, "output_length": 4, "hash_ids": [0, 1, 5]},
    {"timestamp": 3000, "input_length": 2100, "output_length": 9,
     "hash_ids": [0, 1, 3, 4, 6]},
]


def test_grouping_rule(tmp_path):
    trace = read_mooncake(_write(tmp_path, ROWS))
    by_id = {s.session_id: s for s in trace.sessions}
    assert [s.session_id for s in trace.sessions] == ["mc0", "mc1", "mc3"]
    assert [t.timestamp_s for t in by_id["mc0"].turns] == [0.0, 1.5, 3.0]
    assert by_id["mc1"].turns[0].input.length == 600
    branch = by_id["mc3"]
    assert branch.parent is not None
    assert (branch.parent.session_id, branch.parent.turn) == ("mc0", 0)
    assert branch.start_s == 2.0
    assert all(t.context == "replace" for s in trace.sessions for t in s.turns)
    assert {s.meta["source"] for s in trace.sessions} == {"mooncake"}
    assert trace.header.block_size == 512
    # a higher threshold: sharing [0, 1] is no longer enough, so r3 starts its own session
    strict = read_mooncake(_write(tmp_path, ROWS), MooncakeOptions(min_shared_blocks=3))
    assert "mc3" in {s.session_id for s in strict.sessions}
    assert all(s.parent is None for s in strict.sessions)


def test_blocks_expand_to_the_same_tokens(tmp_path):
    sessions = {rs.session.session_id: rs for rs in resolve_all(
        read_mooncake(_write(tmp_path, ROWS)))}
    r0, r2, r4 = sessions["mc0"].turns
    r1 = sessions["mc1"].turns[0]
    r3 = sessions["mc3"].turns[0]
    assert [len(t.prompt) for t in (r0, r1, r2, r3, r4)] == [1100, 600, 1600, 1300, 2100]
    assert r0.prompt[:512] == r1.prompt[:512] == block_tokens(0, 512, block_size=512)
    assert r0.prompt[:1024] == r2.prompt[:1024] == r3.prompt[:1024]
    assert r2.prompt[:1536] == r4.prompt[:1536]
    assert r0.prompt[1024:1100] == block_tokens(2, 76, block_size=512)  # trimmed last block
    assert r1.prompt[512:] != r0.prompt[512:600]
    assert [len(t.forced_output) for t in (r0, r2, r4)] == [10, 7, 9]


def test_scaling_keeps_the_sharing(tmp_path):
    trace = read_mooncake(_write(tmp_path, ROWS), MooncakeOptions(block_tokens=128,
                                                                 max_output_tokens=6))
    sessions = {rs.session.session_id: rs for rs in resolve_all(trace)}
    r0, r2, _ = sessions["mc0"].turns
    # 1100 = 2 full blocks + 76 -> 2*128 + round(76/4) = 275
    assert len(r0.prompt) == 275 and len(r2.prompt) == 3 * 128 + 16
    assert r0.prompt[:256] == r2.prompt[:256]
    assert max(len(t.forced_output) for rs in sessions.values() for t in rs.turns) == 6
    unscaled = ideal_hit(resolve_all(read_mooncake(_write(tmp_path, ROWS))), chunk_size=512)
    scaled = ideal_hit(sessions.values(), chunk_size=128)
    assert scaled.hit_rate == pytest.approx(unscaled.hit_rate, abs=0.05)


def test_bad_rows_are_named(tmp_path):
    path = _write(tmp_path, [ROWS[0], {"timestamp": 1, "input_length": 100, "output_length": 1,
                                       "hash_ids": [0, 1]}])
    with pytest.raises(TraceFormatError, match=r"mc.jsonl:2: 2 hash_ids for 100 tokens"):
        read_mooncake(path)


@pytest.mark.skipif(not REAL.exists(), reason="shared Mooncake trace not present")
def test_real_trace_sample():
    assert detect_format(REAL) == "mooncake"
    n = 1500
    trace = load_trace(REAL, mooncake=MooncakeOptions(max_requests=n))
    assert trace.num_turns == n
    assert trace.header.source.startswith("mooncake")
    multi = [s for s in trace.sessions if len(s.turns) > 1]
    assert multi and len(trace.sessions) < n
    # timestamps never go backwards inside a session
    for s in trace.sessions:
        ts = [t.timestamp_s for t in s.turns]
        assert ts == sorted(ts)

    # The token-level ideal at chunk = block = 512 equals an independent block-level count:
    # leading full blocks whose prefix path some earlier request already had (capped so one
    # token is recomputed).
    rows = [json.loads(line) for line, _ in zip(REAL.open(), range(n), strict=False)]
    seen: set[tuple[int, ...]] = set()
    reusable = total = 0
    for r in rows:
        ids, length = r["hash_ids"], r["input_length"]
        full = length // 512
        k = 0
        while k < min(full, (length - 1) // 512) and tuple(ids[: k + 1]) in seen:
            k += 1
        reusable += 512 * k
        total += length
        seen.update(tuple(ids[: j + 1]) for j in range(full))
    ideal = ideal_hit(resolve_all(trace), chunk_size=512)
    assert ideal.prompt_tokens == total
    assert ideal.reusable_tokens == reusable
    assert 0.2 < ideal.hit_rate < 0.6


def test_the_mooncake_flags_reach_a_command_as_one_options_object():
    import click
    from click.testing import CliRunner

    from agentserving.replay.mooncake import MooncakeOptions
    from agentserving.replay.mooncake_cli import mooncake_options

    seen = []

    @click.command()
    @click.option("--other", default=1)
    @mooncake_options(block_tokens=256, max_output=32)
    def command(other: int, mooncake: MooncakeOptions) -> None:
        seen.append((other, mooncake))

    assert CliRunner().invoke(command, []).exit_code == 0
    assert seen[-1] == (1, MooncakeOptions(block_tokens=256, max_output_tokens=32))
    res = CliRunner().invoke(command, ["--mooncake-block-tokens", "64", "--mooncake-max-input",
                                       "900", "--mooncake-max-requests", "5", "--other", "2"])
    assert res.exit_code == 0, res.output
    assert seen[-1] == (2, MooncakeOptions(max_requests=5, block_tokens=64,
                                           max_output_tokens=32, max_input_tokens=900))
    res = CliRunner().invoke(command, ["--mooncake-block-tokens", "513"])
    assert res.exit_code == 2 and "--mooncake-block-tokens" in res.output
