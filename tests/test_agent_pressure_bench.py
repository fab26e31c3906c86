"""`python -m bench agent_pressure`: what it makes of a compare run's repeats (the runs
themselves need vLLM pods: the bench's own --quick, `make bench`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import agent_pressure_bench as bench

SID = "s"
PAUSES = {(SID, 1): 1.5, (SID, 2): 45.0, (SID, 3): 45.0}  # the pause before each turn


def _summary(jct: float, human: float | None, failed: int = 0, disk_s: float | None = None
             ) -> dict:
    return {"mean_jct_s": jct, "ttft_p50_after_human_pause_s": human, "e2e_p95_s": jct / 2,
            "branch_start_ttft_p90_s": 1.0, "turns_failed": failed, "forced_mismatches": 0,
            "req_per_s": 2.0, "hit_vs_ideal": 0.9, "disk_read_critical_s": disk_s}


def _run(root: Path, repeats: list[dict[str, dict]]) -> None:
    for k, configs in enumerate(repeats, 1):
        folder = root / f"repeat-{k}"
        for name in configs:
            (folder / name).mkdir(parents=True)
            turns = [{"session_id": SID, "ok": True, "turn": 0, "ttft_s": 9.0},
                     {"session_id": SID, "ok": True, "turn": 1, "ttft_s": 0.2 * k},
                     {"session_id": SID, "ok": True, "turn": 2, "ttft_s": 3.0},
                     {"session_id": SID, "ok": False, "turn": 3, "ttft_s": None}]
            (folder / name / "turns.jsonl").write_text(
                "".join(json.dumps(t) + "\n" for t in turns))
        (folder / "report.json").write_text(json.dumps({"configs": configs}))


def test_the_bench_reports_medians_with_their_spread_and_judges_targets_on_them(
        tmp_path, monkeypatch):
    _run(tmp_path, [
        {"agentserving": _summary(10.0, 1.0, disk_s=0.5), "llmd": _summary(20.0, 4.0),
         "agentserving-noprefetch": _summary(11.0, 2.0, disk_s=4.0)},
        {"agentserving": _summary(30.0, None, failed=1, disk_s=1.5), "llmd": _summary(25.0, 5.0),
         "agentserving-noprefetch": _summary(11.0, 2.0, disk_s=5.0)},
        {"agentserving": _summary(12.0, 3.0, disk_s=0.9), "llmd": _summary(21.0, 3.0),
         "agentserving-noprefetch": _summary(11.0, 2.0, disk_s=6.0)}])
    monkeypatch.setattr(bench, "trace_pauses", lambda: PAUSES)
    out = bench.result(tmp_path, "agentserving compare ...", 12.5)
    cand, llmd = out["configs"]["agentserving"], out["configs"]["llmd"]
    assert llmd["median"]["mean_jct_s"] == 21.0
    assert out["repeats"] == 3 and cand["repeats"] == {"n": 3}
    assert cand["median"]["mean_jct_s"] == 12.0 and cand["min"]["mean_jct_s"] == 10.0
    assert cand["max"]["mean_jct_s"] == 30.0
    # a repeat without the figure is left out of its median, not counted as zero
    assert cand["median"]["ttft_p50_after_human_pause_s"] == 2.0
    assert cand["median"]["failed_turns"] == 0 and cand["max"]["failed_turns"] == 1
    # disk reads on the critical path: 0.9 s against 5.0 s, at most x0.2
    assert cand["median"]["disk_read_critical_s"] == 0.9
    assert llmd["median"]["disk_read_critical_s"] is None  # its pods said nothing of it
    disk = [t for t in out["targets"] if t["figure"] == "disk_read_critical_s"]
    assert disk[0]["against"] == "agentserving-noprefetch"
    assert disk[0]["ratio"] == pytest.approx(0.18) and disk[0]["met"]
    targets = {(t["figure"], t["against"]): t for t in out["targets"]}
    jct = targets[("mean_jct_s", "llmd")]
    assert jct["ratio"] == pytest.approx(12.0 / 21.0, abs=1e-3) and jct["met"]
    human = targets[("ttft_p50_after_human_pause_s", "llmd")]
    assert human["ratio"] == 0.5 and human["met"]
    assert targets[("e2e_p95_s", "llmd")]["met"]
    assert not any(t["config"] == "agentserving-toolpin" for t in out["targets"])
    # TTFT by the pause before the turn: first turns and failed turns left out
    curve = {c["pause_from_s"]: c for c in out["ttft_by_pause"]["llmd"]}
    assert curve[1.0]["turns"] == 3 and curve[1.0]["ttft_p50_s"] == pytest.approx(0.4)
    assert curve[40.0]["turns"] == 3 and curve[40.0]["ttft_p50_s"] == 3.0
    assert curve[0.0]["turns"] == 0 and curve[0.0]["ttft_p50_s"] is None
    bench.plot(out["ttft_by_pause"], tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 1000


def test_the_bench_sizes_dram_to_a_third_of_the_working_set_and_asks_compare_for_it(tmp_path):
    args = bench.parse_args(["--quick", "--no-progress"])
    assert (args.configs, args.repeats, args.limit) == ("agentserving,llmd", 1, 6)
    argv = bench.compare_command(args, tmp_path)
    gib = float(argv[argv.index("--cpu-cache-gib") + 1])
    assert gib == bench.dram_per_pod_gib()
    from agentserving.replay.loader import load_trace

    header = load_trace(bench.WORKLOAD).header.generator
    assert gib * bench.PODS * 3 <= header["working_set_gib"] * 1.001
    assert argv[argv.index("--workload") + 1] == "bundled:agent-pressure"
    assert argv[argv.index("--limit") + 1] == "6" and "--no-progress" in argv
    full = bench.parse_args([])
    assert full.repeats == 3 and full.limit is None and "llmd" in full.configs.split(",")


def test_a_run_is_reported_under_the_names_its_flags_have_now(tmp_path, monkeypatch):
    _run(tmp_path, [{"agentserving": _summary(10.0, 1.0), "plain": _summary(8.0, 1.0)}])
    monkeypatch.setattr(bench, "trace_pauses", lambda: PAUSES)
    renamed = bench.renames(["agentserving=agentserving-toolpin", "plain=agentserving"])
    out = bench.result(tmp_path, None, None, renamed)
    assert out["renamed"] == renamed
    assert out["configs"]["agentserving"]["median"]["mean_jct_s"] == 8.0
    assert out["configs"]["agentserving-toolpin"]["median"]["mean_jct_s"] == 10.0
    pins = next(t for t in out["targets"] if t["config"] == "agentserving-toolpin")
    assert pins["ratio"] == 1.25 and not pins["met"]
    assert out["ttft_by_pause"]["agentserving-toolpin"][2]["turns"] == 1  # its own turns
    with pytest.raises(SystemExit, match="expected RAN=NAME"):
        bench.renames(["agentserving"])


def test_the_pauses_come_from_the_trace_human_ones_included():
    pauses = bench.trace_pauses()
    from agentserving.replay.loader import load_trace

    trace = load_trace(bench.WORKLOAD)
    human = [(s.session_id, k) for s in trace.sessions for k, t in enumerate(s.turns)
             if t.meta.get("pause") == "human"]
    assert human and all(pauses[key] > 0 for key in human)
    assert max(pauses[key] for key in human) > 10  # tens of seconds: what strains DRAM


def test_a_folder_without_reports_is_an_error_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        bench.result(tmp_path, None, None)
