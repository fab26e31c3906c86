"""The fault bench: its verdicts on hand-made attempts (``bench.fault_plan``, pure), and one
smoke run end to end (``--quick``: a fault-free fleet and one faulty fleet of real processes
on loopback, reference engine). Checks what the JSON promises, never timings against a
target: the machine is shared."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from agentserving.engine import failpoints
from testkit.servers import import_bench

plan = import_bench("fault_plan")
bench = import_bench("faults_bench")
injection = import_bench("fault_injection")

Attempt, TurnResult = plan.Attempt, plan.TurnResult


def ok(tokens: list[int], started: float = 0.0, retried: list[str] | None = None) -> Attempt:
    return Attempt(started, started + 1, status=200, tokens=tokens, done=True, finished=True,
                   proxy_retried=retried or [])


def test_each_way_an_attempt_ends_is_told_apart():
    assert plan.attempt_kind(ok([1])) == "ok"
    cut = Attempt(0, 1, status=200, tokens=[1, 2])  # body ended: no error, no [DONE]
    assert plan.attempt_kind(cut) == "silent_cut" and not plan.retriable(cut)
    mid = Attempt(0, 1, status=200, tokens=[1], done=True, error_type="upstream_error",
                  error_message="worker decode-1 failed mid-stream")
    assert plan.attempt_kind(mid) == "stream_error" and plan.retriable(mid)
    bad = Attempt(0, 1, status=200, done=True, error_type="invalid_request_error")
    assert plan.attempt_kind(bad) == "stream_error" and not plan.retriable(bad)
    lost = Attempt(0, 1, transport_error="RemoteProtocolError: peer closed")
    assert plan.attempt_kind(lost) == "connection" and plan.retriable(lost)
    assert plan.retriable(Attempt(0, 1, status=502)) and plan.retriable(Attempt(0, 1, status=429))
    assert not plan.retriable(Attempt(0, 1, status=400))


def test_turn_outcomes_and_wrong_outputs_against_the_reference():
    reference = {(0, 0): [5, 6, 7], (0, 1): [8, 9], (1, 0): [1]}
    results = [
        TurnResult(0, 0, [ok([5, 6, 7])]),
        TurnResult(0, 1, [Attempt(2, 3, status=200, tokens=[8], done=True,
                                  error_type="upstream_error"), ok([8, 4], started=4)]),
        TurnResult(1, 0, [ok([1], retried=["decode-1"])]),
        TurnResult(1, 1, [Attempt(5, 6, status=503)]),
    ]
    assert [plan.turn_outcome(t) for t in results] == ["ok", "recovered",
                                                       "retried_transparently", "failed"]
    wrong = plan.wrong_outputs(results, reference)
    assert wrong == [{"session": 0, "turn": 1, "first_diff": 1, "got": [8, 4], "want": [8, 9],
                      "decode_pod": None}]
    # the first answered turn sent after the injection at t=3.5 is s0t1's retry, at 4 -> 5
    assert plan.recovery_s(results, 3.5) == 1.5
    assert plan.recovery_s(results, 10.0) is None
    row = plan.summarize_fault("x", results, reference, 3.5, 7.0, [])
    assert row["turns_failed"] == 2 and row["turns_failed_for_good"] == 1
    assert (row["turns_affected"], row["failed_turns"], row["retried_ok"]) == (3, 1, 2)
    assert row["turns_retried_transparently"] == 1 and row["wrong_outputs"] == 1
    assert row["failed_after_tokens"] == {"total": 1, "retriable": 1}
    assert row["silent_cuts"] == 0 and row["healthy_s"] == 3.5


def test_the_workload_is_the_same_every_time_and_grows_by_appends():
    a, b = plan.build_turns(plan.QUICK_WORKLOAD), plan.build_turns(plan.QUICK_WORKLOAD)
    assert [[t.prompt for t in s] for s in a] == [[t.prompt for t in s] for s in b]
    w = plan.QUICK_WORKLOAD
    first, second = a[0][0], a[0][1]
    assert len(first.prompt) == w.first_tokens
    assert second.prompt[:len(first.prompt)] == first.prompt  # teacher-forced context
    assert len(second.prompt) == w.first_tokens + w.output_tokens + w.append_tokens
    body = plan.request_body(second, "tiny", w.output_tokens)
    assert body["temperature"] == 0.0 and "forced_output_token_ids" not in body  # greedy


def test_corrupting_flips_bytes_but_keeps_every_file_size(tmp_path: Path):
    (tmp_path / "a").mkdir()
    f = tmp_path / "a" / "chunk.pt"
    f.write_bytes(bytes(range(256)) * 64)
    (tmp_path / injection.FILLER).write_bytes(b"\0" * 64)
    assert injection.corrupt_files(tmp_path) == 1
    data = f.read_bytes()
    assert len(data) == 256 * 64 and data != bytes(range(256)) * 64
    assert (tmp_path / injection.FILLER).read_bytes() == b"\0" * 64


def test_ports_stay_in_their_range_and_never_repeat():
    ports = injection.RangePorts(19500, 19690, start=40)
    got = [ports.run(4) for _ in range(5)] + [ports.one() for _ in range(5)]
    assert all(19500 <= p < 19690 for p in got) and len(set(got)) == len(got)


@pytest.mark.skipif(shutil.which("redis-server") is None,
                    reason="needs redis-server (make setup installs Debian's)")
@pytest.mark.timeout(240)
def test_quick_run_injects_and_finds_no_wrong_output(tmp_path: Path):
    out = tmp_path / "faults.json"
    assert bench.main(["--quick", "--no-progress", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["bench"] == "faults" and report["quick"] is True
    rows = report["faults"]
    assert set(rows) == set(plan.QUICK_FAULTS) and report["engine"] == "reference"
    for row in rows.values():
        assert row["injected"] and row["notes"], row
        assert row["turns"] == row["turns_planned"]  # no session was abandoned
        assert row["wrong_outputs"] == 0 and row["silent_cuts"] == 0
        assert row["turns_failed_for_good"] == 0 == row["failed_turns"]
        assert row["recovery_s"] is not None and row["healthy_s"] is not None
    assert all(t["met"] for t in report["targets"].values())


@pytest.mark.skipif(shutil.which("redis-server") is None,
                    reason="needs redis-server (make setup installs Debian's)")
@pytest.mark.timeout(900)
def test_quick_run_on_vllm_keeps_every_answer_through_corrupt_kv(tmp_path: Path):
    """The reduced vLLM run: a fault-free fleet of vLLM pods, then one whose disk-tier chunk
    files are corrupted under it, its DRAM and prefix caches emptied (run before the vLLM
    tests' shared fleet starts: the suites run in testpaths order, and two fleets of vLLM pods
    do not fit one machine's memory). Whether a turn meets a corrupt chunk here depends on the
    timing (e2e/vllm tests each fallback on a pod); what must hold is every answer."""
    from testkit.vllm_env import require_serving_env

    require_serving_env()
    out = tmp_path / "faults.json"
    assert bench.main(["--quick", "--engine", "vllm", "--faults", "corrupt-disk",
                       "--no-progress", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["engine"] == "vllm" and report["reference_reproducible"] is None
    row = report["faults"]["corrupt-disk"]
    assert row["injected"] and row["turns"] == row["turns_planned"]
    assert any(n.startswith("corrupted ") and not n.startswith("corrupted 0 ")
               for n in row["notes"]), row["notes"]
    assert row["wrong_outputs"] == 0 and row["failed_turns"] == 0 and row["silent_cuts"] == 0
    # what the pods served from, counted where a vLLM pod counts it (its memory ports)
    assert any(k.startswith("cached_tokens_total") for k in row["worker_kv_counters"]), row


def test_a_vllm_fleet_is_agentserving_as_the_main_job_deploys_it(tmp_path: Path):
    """The vLLM fleet's pods: P/D through each pod's own KV server (what the KV-server faults
    break), LMCache's tiers on the bench's disk, its kvindex on the bench's Redis; and a
    fault for what a reference fleet lacks is skipped, not run."""
    spec = bench.fleet_spec("vllm", "redis://127.0.0.1:1/0", tmp_path)
    assert (spec.engine, spec.prefill, spec.decode) == ("vllm", 1, 2)
    assert spec.kvindex == "redis://127.0.0.1:1/0" and spec.disk_cache_root == tmp_path
    specs = bench.build(spec, tmp_path, injection.RangePorts(*bench.PORTS))
    names = {s.name for s in specs}
    assert {"kvserver-prefill-0", "prefill-0", "decode-0", "decode-1", "proxy"} <= names
    pod = next(s for s in specs if s.name == "decode-0")
    host, port = pod.memory_url.rsplit(":", 1)
    from agentserving.replay.fleet.process import ManagedProcess

    assert bench.metrics_urls(ManagedProcess(pod, tmp_path)) == [pod.memory_url,
                                                                 f"{host}:{int(port) + 1}"]
    # the pods serve failpoints, which the layer-copy fault arms (vLLM's layer-wise load)
    assert pod.env[failpoints.ENV] == "1"
    assert plan.FAULTS["kill-kvserver"].engines == plan.FAULTS["layer-copy"].engines == (
        "vllm",)
    assert "layer-copy" in bench.parse_args(["--engine", "vllm"]).fault_names
    assert "layer-copy" not in bench.parse_args([]).fault_names
    args = bench.parse_args(["--engine", "vllm", "--faults", "kill-kvserver"])
    assert args.restart_timeout_s > bench.RESTART_TIMEOUT_S["reference"]
