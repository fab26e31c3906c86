"""`agentserving compare` end to end on a cut-down workload (the main job, smaller)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agentserving.replay.metrics import METRIC_KEYS
from agentserving.replay.testing import AGENTSERVING, has_subcommand, pid_alive


@pytest.mark.slow
@pytest.mark.skipif(not (has_subcommand("worker") and has_subcommand("proxy")),
                    reason="`agentserving worker` / `agentserving proxy` are not available yet")
def test_bench_writes_report_and_plots(tmp_path):
    run_dir = tmp_path / "run"
    # the smaller-context workload: this checks the wiring and the reuse, not the speed-up
    out = subprocess.run([AGENTSERVING, "compare", "--engine", "reference",
                          "--workload", "bundled:bench-small",
                          "--limit", "3", "--decode", "1",
                          "--no-progress", "--run-dir", str(run_dir)],
                         capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert set(report["configs"]) == {"baseline", "agentserving"}
    assert report["settings"]["time_scale"] == 1.0  # the reference engine's own pace (vLLM: 0.5)
    for m in report["configs"].values():
        assert set(METRIC_KEYS) <= set(m)
        assert m["turns_failed"] == 0 and m["turns_not_sent"] == 0
    assert set(METRIC_KEYS) == set(report["ratios"])
    base, cand = report["configs"]["baseline"], report["configs"]["agentserving"]
    assert cand["prefix_hit_rate"] > base["prefix_hit_rate"] + 0.3
    assert cand["hit_vs_ideal"] >= 0.95  # the target: KV-aware routing finds it all
    assert report["checks"]["hit_vs_ideal"]["ok"] and report["checks"]["failed_turns"]["ok"]

    def computed(m):  # prompt tokens the workers actually ran through the model
        return sum(w.get("computed_prompt_tokens_total", 0) for w in m["workers"].values())
    assert computed(cand) < 0.35 * computed(base)
    assert computed(base) >= 0.95 * base["prompt_tokens"]  # baseline reuses nothing
    for name in ("latency_cdf", "throughput", "hit_rate", "ratios"):
        assert (run_dir / "plots" / f"{name}.png").stat().st_size > 5000
    assert f"report: {run_dir / 'report.json'}" in out.stdout
    # agentserving's workers had a disk tier under the run; its KV files went with the fleet
    fleet = (run_dir / "fleets" / "agentserving" / "fleet.json").read_text()
    assert "--disk-cache-dir" in fleet
    assert not (run_dir / "fleets" / "agentserving" / "disk").exists()


STUB = Path(__file__).resolve().parents[2] / "replay" / "tests" / "stub_worker.py"


@pytest.mark.skipif(not has_subcommand("proxy"), reason="`agentserving proxy` not available")
def test_bench_wiring_with_a_stand_in_worker(tmp_path):
    """The whole main job — fleets, real kvindex and proxy, replay, report — with the
    stand-in worker (same flags and HTTP contract, simulated costs)."""
    run_dir = tmp_path / "run"
    out = subprocess.run([AGENTSERVING, "compare", "--engine", "reference", "--limit", "4",
                          "--no-progress",
                          "--run-dir", str(run_dir),
                          "--worker-command", f"{sys.executable} {STUB}"],
                         capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    base, cand = report["configs"]["baseline"], report["configs"]["agentserving"]
    assert base["turns_failed"] == cand["turns_failed"] == 0
    assert base["turns_completed"] == cand["turns_completed"] == report["workload"]["turns"]
    assert base["prefix_hit_rate"] == 0.0  # 1 MiB CPU tier: nothing is kept
    assert cand["hit_vs_ideal"] > 0.9  # kv-aware routing to the one prefill pod
    assert report["checks"]["failed_turns"]["ok"]
    recs = [json.loads(line) for line in
            (run_dir / "agentserving" / "turns.jsonl").read_text().splitlines()]
    assert {r["decode_pod"] for r in recs} <= {"decode-0", "decode-1"}
    # first turns go P/D; short appends run whole on the session's decode pod
    paths = {r["routing"]["x-agentserving-pd"] for r in recs}
    assert paths == {"disaggregated", "local"}
    for r in recs:
        local = r["routing"]["x-agentserving-pd"] == "local"
        assert r["prefill_pod"] == (r["decode_pod"] if local else "prefill-0")
        assert not (local and r["turn"] == 0 and r["parent_session_id"] is None)
    base_recs = [json.loads(line) for line in
                 (run_dir / "baseline" / "turns.jsonl").read_text().splitlines()]
    assert len({r["prefill_pod"] for r in base_recs}) == 3  # round-robin over 3 workers
    assert all(r["decode_pod"] is None for r in base_recs)  # no P/D
    for name in ("latency_cdf", "throughput", "hit_rate", "ratios"):
        assert (run_dir / "plots" / f"{name}.png").stat().st_size > 5000
    assert "request throughput" in out.stdout and f"report: {run_dir / 'report.json'}" \
        in out.stdout
    # every process of both fleets is gone
    logs = sorted(p.relative_to(run_dir / "logs").as_posix()
                  for p in (run_dir / "logs").rglob("*.log"))
    assert len(logs) == 10 and "agentserving/proxy.log" in logs and "baseline/worker-2.log" in logs
    fleets = [json.loads(p.read_text()) for p in (run_dir / "fleets").rglob("fleet.json")]
    assert len(fleets) == 2
    assert not [p["pid"] for f in fleets for p in f["processes"] if pid_alive(p["pid"])]


@pytest.mark.skipif(not has_subcommand("proxy"), reason="`agentserving proxy` not available")
def test_repeats_run_interleaved_and_report_medians(tmp_path):
    """--repeats 2 with the stand-in worker: A B, A B; each figure the median of the repeats'
    own reports, min and max beside it, plots from the median repeat."""
    run_dir = tmp_path / "run"
    out = subprocess.run([AGENTSERVING, "compare", "--engine", "reference", "--limit", "2",
                          "--no-progress", "--repeats", "2", "--run-dir", str(run_dir),
                          "--worker-command", f"{sys.executable} {STUB}"],
                         capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    replayed = [line.split("]")[0].lstrip("[") for line in out.stdout.splitlines()
                if "] replaying " in line]
    assert replayed == ["baseline", "agentserving", "baseline", "agentserving"]
    report = json.loads((run_dir / "report.json").read_text())
    runs = [json.loads((run_dir / f"repeat-{k}" / "report.json").read_text()) for k in (1, 2)]
    assert report["repeats"]["n"] == 2 and report["repeats"]["dirs"] == ["repeat-1", "repeat-2"]
    for name in ("baseline", "agentserving"):
        m, values = report["configs"][name], [r["configs"][name] for r in runs]
        assert m["repeats"]["n"] == 2
        for key in ("req_per_s", "e2e_p95_s", "turns_completed"):
            lo, hi = sorted(v[key] for v in values)
            assert m["repeats"]["min"][key] == lo and m["repeats"]["max"][key] == hi
            assert m[key] == pytest.approx((lo + hi) / 2, rel=1e-5)
        k = m["repeats"]["median_repeat"]
        assert (run_dir / f"repeat-{k}" / name / "turns.jsonl").exists()
    # targets on the medians; each repeat's ratio kept beside them
    med = report["configs"]
    assert report["ratios"]["req_per_s"] == pytest.approx(
        med["agentserving"]["req_per_s"] / med["baseline"]["req_per_s"], rel=1e-5)
    per = report["repeats"]["ratios"]["baseline"]["req_per_s"]
    assert per["values"] == [r["comparisons"]["baseline"]["ratios"]["req_per_s"] for r in runs]
    assert per["worst"] == min(per["values"])
    assert "over 2 interleaved repeats" in out.stdout
    for name in ("latency_cdf", "throughput", "hit_rate", "ratios"):
        assert (run_dir / "plots" / f"{name}.png").stat().st_size > 5000
