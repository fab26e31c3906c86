"""``python -m bench proxy --quick`` end to end: every path answers, the in-process replica
answers every kv-aware lookup with four prefill pods, the control path asks the kvindex, and
the one-pod path looks nothing up."""

from __future__ import annotations

import json

from testkit.servers import import_bench

proxy_bench = import_bench("proxy_bench")


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
