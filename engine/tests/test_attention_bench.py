"""The attention bench runs through ``python -m bench`` at smoke sizes and writes both
implementations' timings side by side."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_attention_bench_writes_both_timings(tmp_path: Path) -> None:
    out = tmp_path / "attention.json"
    proc = subprocess.run([sys.executable, "-m", "bench", "attention", "--quick", "--out",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["seconds"]) == {"sdpa", "agentserving_grid"}
    assert all(v > 0 for v in result["seconds"].values())
    assert result["grid_over_sdpa"] > 0
