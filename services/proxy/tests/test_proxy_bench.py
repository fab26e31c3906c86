"""``python -m bench proxy --quick`` end to end: every path answers, the in-process replica
answers every kv-aware lookup with four prefill pods, the control path asks the kvindex, and
the one-pod path looks nothing up."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]  # the repository root, where ``bench/`` lives
if str(ROOT) not in sys.path:  # (pytest's importlib mode does not add it)
    sys.path.append(str(ROOT))
proxy_bench = importlib.import_module("bench.proxy_bench")


def test_the_proxy_bench_compares_every_path(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "proxy.json"
    assert proxy_bench.main(["--quick", "--no-progress", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["paths"]) == {"direct", *proxy_bench.PATHS}
    assert report["workers"] == "standin"
    looked = report["lookups"]
    turns = report["turns"]
    assert looked["kv-aware-4"].get("replica", 0) >= turns
    assert looked["kv-aware-4"].get("kvindex", 0) == 0
    assert looked["kv-aware-4-kvindex"].get("kvindex", 0) >= turns
    assert looked["kv-aware-1"] == {} and looked["round-robin-4"] == {}
    for name in proxy_bench.PATHS:
        assert report["added_ms"][name]["p99"] >= report["added_ms"][name]["p50"]
    assert isinstance(report["target"]["met"], bool)
