"""The kvindex benchmark runs end to end at smoke sizes (``--quick``) through ``python -m bench``
and writes JSON with every number the report promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_bench_runner_lists_the_kvindex_bench() -> None:
    out = subprocess.run([sys.executable, "-m", "bench", "--help"], cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=60).stdout
    assert "kvindex" in out.split("benchmarks:")[1]


def test_kvindex_bench_quick_writes_both_backends_side_by_side(tmp_path: Path) -> None:
    out = tmp_path / "kvindex.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "kvindex", "--quick", "--no-progress", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "lookup p99" in proc.stdout  # the table was printed
    report = json.loads(out.read_text())
    assert report["bench"] == "kvindex" and report["quick"] is True
    assert report["config"]["pods"] == 16 and report["config"]["chain"] == 512
    for backend in ("memory", "redis"):
        result = report[backend]
        lookup, ingest = result["lookup"], result["ingest"]
        assert lookup["pods_found"] == 16
        assert 0 < lookup["p50_ms"] <= lookup["p99_ms"] <= lookup["max_ms"]
        for key in ("chunk_events_per_s", "sequential_chunk_events_per_s",
                    "growth_chunk_events_per_s"):
            assert ingest[key] > 0, (backend, key)
        assert result["preload_chunks_per_s"] > 0
    assert set(report["ratios"]) == {"ingest", "ingest_sequential", "ingest_growth",
                                     "lookup_p50", "lookup_p99"}
    assert all(v > 0 for v in report["ratios"].values())
    assert set(report["targets"]) >= {"redis_ingest_met", "redis_lookup_p99_met"}
