"""The control-plane load bench runs end to end at smoke sizes (``--quick``): real proxy, real
kvindex on a real Redis, stand-in workers as real processes, all on loopback. Checks what the
JSON promises (counts, errors, the added-latency and lookup figures, the index's growth), never
timings against a target: the machine is shared."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from testkit.servers import import_bench

bench = import_bench("control_plane_load_bench")

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="needs redis-server (make setup installs Debian's)")


def test_quick_run_serves_every_turn_through_proxy_kvindex_and_redis(tmp_path: Path) -> None:
    out = tmp_path / "control_plane_load.json"
    assert bench.main(["--quick", "--no-progress", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    cfg = report["config"]
    assert report["bench"] == "control_plane_load" and report["quick"] is True
    assert report["errors"] == {"total": 0, "by_kind": {}, "examples": {}}
    assert report["turns"] == report["turns_ok"] == cfg["sessions"] * cfg["turns_per_session"]
    assert report["direct_calls"] == report["turns"]  # every turn sent straight too
    assert report["turns_per_s"] > 0
    for path in ("through_proxy", "direct"):
        lat = report["latency_ms"][path]
        assert lat["samples"] == report["turns"]
        assert 0 < lat["p50_ms"] <= lat["p99_ms"] <= lat["max_ms"]
    added = report["added_ms"]
    assert added["pairs"] == report["turns"]
    for key in ("p50_ms", "p99_ms", "paired_p50_ms"):
        assert added[key] is not None and added[key] >= 0, key
    assert added["paired_p99_ms"] is not None
    lookups = report["kvindex_lookup_ms"]
    assert lookups["http_from_bench"]["samples"] > 0
    # a chain answered a moment ago may not be indexed yet (events are batched): most are
    assert lookups["http_from_bench"]["hits"] > lookups["http_from_bench"]["samples"] / 2
    assert lookups["redis_backend_histogram"]["count"] > 0  # the proxy's lookups, on Redis
    assert report["proxy_routing_ms_histogram"]["count"] > report["turns"]
    # kv-aware routing had chunk hashes to look up from the second turn on, and used them
    routing = report["routing"]
    assert routing["later_turns"] == cfg["sessions"] * (cfg["turns_per_session"] - 1)
    assert routing["kv_hits"] > 0 and routing["kvindex_counters"]["lookups"]["result=hit"] > 0
    assert len(routing["turns_by_pod"]) == cfg["standin_workers"]
    # the index grew: every stand-in registered and published what it holds
    index = report["index"]
    assert index["pods"] == cfg["standin_workers"]
    assert index["converged"] and index["pod_chunks"] == index["standin_chunks_held"] > 0
    assert index["redis_chunk_table_entries"] == index["distinct_chunks_served"] > 0
    assert index["redis_dbsize"] > 0
    rss = report["peak_rss_mib"]
    assert all(rss[p] and rss[p] > 0 for p in ("proxy", "kvindex", "redis"))
    assert set(report["targets"]) == {"errors", "added_p99_ms"}
    assert report["targets"]["errors"]["met"] is True


def test_help_explains_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--sessions", "--turns", "--first-tokens", "--append-tokens", "--output-tokens",
                 "--think-s", "--ramp-s", "--workers", "--chunk-size", "--lookup-rate",
                 "--seed", "--logs", "--no-progress", "--quick", "--out"):
        assert flag in text, flag
