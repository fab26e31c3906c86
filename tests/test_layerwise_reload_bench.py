"""``python -m bench layerwise_reload --quick`` on the CPU: the three ways run, each reload is
checked against the resident KV, and the JSON carries what the docs' table reads."""

from __future__ import annotations

import json
from pathlib import Path

from bench import layerwise_reload_bench


def test_quick_run_writes_every_case_with_its_kv_wait(tmp_path: Path) -> None:
    out = tmp_path / "lw.json"
    assert layerwise_reload_bench.main(["--quick", "--device", "cpu", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(c["context"], c["chunk"]) for c in result["cases"]] == [(1024, 64)]
    for case in result["cases"]:
        # 2 layers x K,V x 1024 tokens x 2 KV heads x 64 dims x 2 bytes (bfloat16)
        assert case["kv_bytes"] == 2 * 2 * 1024 * 2 * 64 * 2
        assert set(case["p50_ms"]) == {"resident", "whole", "layerwise"}
        assert all(len(s) == 3 for s in case["samples_ms"].values())
        assert all(v >= 0 for v in case["exposed_kv_wait_ms"].values())
    assert result["staging"].startswith("cpu") and result["run"]["argv"] is not None
