"""`agentserving trace generate / mooncake / stats`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from agentserving.core.cli import main
from agentserving.replay.trace import read_trace

REAL = Path(__file__).resolve().parents[3] / "shared/data/mooncake/conversation_trace.jsonl"


def test_generate_is_deterministic_and_readable(tmp_path):
    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    for path, seed in ((a, "3"), (b, "3"), (c, "4")):
        res = CliRunner().invoke(main, ["trace", "generate", "--preset", "bench-small",
                                        "--sessions", "5", "--seed", seed, "--out", str(path)])
        assert res.exit_code == 0, res.output
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    trace = read_trace(a)
    assert len([s for s in trace.sessions if s.parent is None]) == 5
    assert trace.header.generator["seed"] == 3 and trace.header.source == "synthetic:bench-small"
    res = CliRunner().invoke(main, ["trace", "stats", str(a)])
    stats = json.loads(res.output)
    assert stats["turns"] == trace.num_turns and 0.5 < stats["ideal_hit_rate"] < 1


@pytest.mark.skipif(not REAL.exists(), reason="shared Mooncake trace not present")
def test_mooncake_conversion(tmp_path):
    out = tmp_path / "mc.jsonl"
    res = CliRunner().invoke(main, ["trace", "mooncake", "--input", str(REAL),
                                    "--max-requests", "300", "--block-tokens", "256",
                                    "--max-output", "16", "--out", str(out)])
    assert res.exit_code == 0, res.output
    trace = read_trace(out)
    assert trace.num_turns == 300 and trace.header.block_size == 256
    assert max(t.num_output_tokens() for s in trace.sessions for t in s.turns) == 16
    res = CliRunner().invoke(main, ["trace", "stats", str(REAL), "--mooncake-block-tokens",
                                    "256", "--limit", "20"])
    assert json.loads(res.output)["sessions"] >= 20
