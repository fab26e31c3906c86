"""The reference engine's own scheduler, pods sharing a host's cores, the calibrated profile's
construction, and the validation's fit of a run's host load (round trip on a known one)."""

from __future__ import annotations

import pytest

from agentserving.replay.loader import load_trace
from agentserving.replay.trace import sessions_from
from agentserving.sim import SimConfig, load_profile, simulate
from agentserving.sim.calibrate import build_profile
from agentserving.sim.events import EventLoop
from agentserving.sim.host import Host
from agentserving.sim.profile import Profile
from agentserving.sim.validate import fit_environment, real_forward_s, validate
from agentserving.sim.workload import compile_trace
from testkit.sim import toy_profile


def toy(**kw) -> Profile:
    """The toy profile with the reference engine's scheduler section."""
    return toy_profile(**{"engine": {"scheduler": "fcfs", "prefill_chunk_tokens": 512,
                                     "max_running": 16}, **kw})


def test_processor_sharing_hand_computed():
    loop, ends = EventLoop(), {}
    host = Host(loop, cores=1)
    done = lambda name: ends.__setitem__(name, loop.now)  # noqa: E731
    host.start("a", 1.0, done, "a")
    # b joins at 0.5: a has 0.5 left and both run at half speed -> a ends at 1.5; b has done
    # 0.5 of its 1.0 by then and runs alone -> 2.0
    loop.at(0.5, lambda: host.start("b", 1.0, done, "b"))
    # c carries one background competitor of its own: alone it runs at 1 / (1 + 1)
    loop.at(3.0, lambda: host.start("c", 1.0, done, "c", background=1.0))
    loop.run()
    assert ends == pytest.approx({"a": 1.5, "b": 2.0, "c": 5.0})
    assert host.busy_core_s == pytest.approx(2.0 + 2.0)


def test_engine_fcfs_steps_hand_computed():
    # the reference engine's FcfsPolicy with 512-token budgets, chunk 256: a 1000-token
    # prompt runs [0, 512), [512, 768) (the last full chunk), then the 232-token tail alone
    trace = sessions_from([{"session_id": "s", "start_s": 0.0, "turns": [
        {"input": {"length": 1000}, "output_tokens": 11}]}])
    res = simulate(compile_trace(trace), toy(),
                   SimConfig(config="baseline", topology="1x1", engine_scheduler=True))
    (rec,) = res.records
    assert rec["ttft_s"] == pytest.approx(3 * 0.1 + 1.0)
    assert rec["e2e_s"] == pytest.approx(1.3 + 10 * 0.01)
    assert res.summary["sim"]["forward_s"] == pytest.approx(1.4)


def test_shared_host_slows_two_pods():
    trace = sessions_from([{"session_id": f"s{i}", "start_s": 0.0, "turns": [
        {"input": {"length": 1000}, "output_tokens": 1}]} for i in range(2)])
    own = simulate(compile_trace(trace), toy(),
                   SimConfig(config="baseline", topology="2x1", engine_scheduler=True))
    shared = simulate(compile_trace(trace), toy(host_cores=1),
                      SimConfig(config="baseline", topology="2x1", engine_scheduler=True))
    assert [r["e2e_s"] for r in own.records] == pytest.approx([1.3, 1.3])
    # both prefill at once on one core: every step takes twice as long
    assert [r["e2e_s"] for r in shared.records] == pytest.approx([2.6, 2.6])


def test_engine_scheduler_needs_an_engine_section():
    with pytest.raises(ValueError, match="engine"):
        simulate([], toy(engine=None), SimConfig(engine_scheduler=True))


def test_build_profile_from_measurements():
    m = {"model": "tiny", "kv_bytes_per_token": 8192,
         "prefill_coef": [0.002, 6e-5, 0.0, 7e-8], "decode_coef": [0.006, 3e-6],
         "kv_load_s_per_chunk": {"cpu": 0.0005, "disk": 0.0025},
         "kv_store_s_per_chunk": 0.001, "handoff_wire": {"bytes": 8_000_000, "seconds": 0.01},
         "host_cores": 8}
    prof = build_profile(m, {"cpus": 2})
    assert prof.prefill.d_s == 7e-8 and prof.decode.b_s == 0.006
    assert prof.host_cores == 2                      # the run's host, not the calibrating one
    assert prof.engine is not None and prof.engine.scheduler == "fcfs"
    assert prof.bandwidth.pod_to_pod_gbps == pytest.approx(0.8)
    assert prof.bandwidth.device_to_dram_gbps == pytest.approx(256 * 8192 / 0.001 / 1e9)
    assert prof.chunk_s(256, 1024) == pytest.approx(6e-5 * 256 + 7e-8 * 256 * (1024 + 128.5))


def _fake_real_report(res, role: str = "both") -> dict:
    """A bench-shaped report whose metrics are a simulated run's (a run with a known host)."""
    summary = dict(res.summary)
    summary["fleet"] = {"processes": [{"name": "w", "role": role}]}
    summary["workers"] = {"w": {"prefill_seconds_sum": res.summary["sim"]["forward_s"],
                                "decode_seconds_sum": 0.0}}
    return summary


def test_validation_recovers_a_known_host_load():
    prof = load_profile("reference-cpu")
    ss = compile_trace(load_trace("bundled:bench-small"), chunk=256)
    truth = simulate(ss, prof, SimConfig(config="baseline", topology="1P2D",
                                         engine_scheduler=True,
                                         host_background_roles={"both": 2.0}))
    real = {"settings": {"prefill": 1, "decode": 2, "rate": None},
            "configs": {"baseline": _fake_real_report(truth)}}
    assert real_forward_s(real["configs"]["baseline"]) == {
        "both": truth.summary["sim"]["forward_s"]}
    env = fit_environment(ss, prof, "baseline", "1P2D", None,
                          real_forward_s(real["configs"]["baseline"]))
    # (2.0: where forward seconds grow steadily with the load; under processor sharing the
    # curve has flat stretches, e.g. 1.38-1.5 with the profile re-taken on the paged pool,
    # where a load cannot be told from its neighbours and the fit may land anywhere in them)
    assert env["both"] == pytest.approx(2.0, abs=0.05)
    out = validate(real, ss, prof)
    row = out["configs"]["baseline"]
    assert abs(row["fitted"]["req_per_s"]["error"]) < 0.03
    assert abs(row["fitted"]["e2e_p95_s"]["error"]) < 0.05
    # without the host's load the same fleet looks much faster
    assert row["idle_host"]["req_per_s"]["error"] > 0.2
    assert out["within_15pct"]


def test_conditional_disaggregation_runs_short_appends_on_the_decode_pod():
    """The proxy's rule in the simulator: turn 1 goes P/D; a 200-token append runs whole on
    the session's decode pod (its context cached there); a 3000-token append goes P/D again.
    Off (0), every turn is P/D. The real report's settings say which applies."""
    from agentserving.sim.validate import proxy_knobs_of

    trace = sessions_from([{"session_id": "s", "start_s": 0.0, "turns": [
        {"input": {"length": 1000}, "output_tokens": 4, "tool_gap_s": 0.1},
        {"input": {"length": 200}, "output_tokens": 4, "tool_gap_s": 0.1},
        {"input": {"length": 3000}, "output_tokens": 4}]}], block_size=256)

    def pods(local: int) -> list[tuple[str, str]]:
        res = simulate(compile_trace(trace), toy(), SimConfig(
            config="agentserving", topology="1P2D", engine_scheduler=True,
            local_prefill_tokens=local))
        recs = sorted(res.records, key=lambda r: r["turn"])
        assert [r["ok"] for r in recs] == [True] * 3
        return [(r["prefill_pod"], r["decode_pod"]) for r in recs]

    on = pods(2048)
    assert on[0][0] == "prefill-0" and on[1] == (on[0][1], on[0][1])  # local, same pod
    assert on[2][0] == "prefill-0"
    assert all(p == "prefill-0" for p, _ in pods(0))
    assert proxy_knobs_of({"settings": {"proxy_args": ["--local-prefill-tokens=0"]},
                           "configs": {}})["local_prefill_tokens"] == 0
    had = {"configs": {"agentserving": {"per_turn": {"local_prefill_share": 0.8}}}}
    assert proxy_knobs_of(had) == {"local_prefill_tokens": 2048, "max_prefill_backlog": 0}
    assert proxy_knobs_of({**had, "settings": {"proxy_args": [
        "--max-prefill-backlog", "3"]}}) == {"local_prefill_tokens": 2048,
                                              "max_prefill_backlog": 3}
    assert proxy_knobs_of({"configs": {"agentserving": {"per_turn": {}}}}) == {
        "local_prefill_tokens": 0, "max_prefill_backlog": 0}


def _pods_by_turn(trace, **cfg) -> list[tuple[str, str]]:
    res = simulate(compile_trace(trace), toy(), SimConfig(
        config="agentserving", topology="1P2D", engine_scheduler=True, **cfg))
    recs = sorted(res.records, key=lambda r: (r["session_id"], r["turn"]))
    assert all(r["ok"] for r in recs)
    return [(r["prefill_pod"], r["decode_pod"]) for r in recs]


def test_a_long_append_stays_on_the_decode_pod_when_the_prefill_pod_lacks_more():
    """The proxy's kvindex check, simulated: after eight local turns the prefill pod holds only
    the first turn's 3 chunks, so a 2,300-token append (2,372 tokens to compute on the decode
    pod, over the threshold) would cost the prefill pod 4,932 — at least 2,048 more — and runs
    locally. Without local turns before it the same append goes P/D."""
    turns = [{"input": {"length": 1000}, "output_tokens": 4, "tool_gap_s": 0.1}]
    turns += [{"input": {"length": 300}, "output_tokens": 4, "tool_gap_s": 0.1}] * 8
    turns += [{"input": {"length": 2300}, "output_tokens": 4}]
    pods = _pods_by_turn(sessions_from([{"session_id": "s", "start_s": 0.0, "turns": turns}],
                                       block_size=256), local_prefill_tokens=2048)
    assert pods[0][0] == "prefill-0"
    assert all(p == d == pods[0][1] for p, d in pods[1:])  # the last one included
    short = [turns[0], turns[-1]]
    pods = _pods_by_turn(sessions_from([{"session_id": "s", "start_s": 0.0, "turns": short}],
                                       block_size=256), local_prefill_tokens=2048)
    assert [p for p, _ in pods] == ["prefill-0", "prefill-0"]


def test_a_saturated_prefill_pool_sends_first_turns_to_a_decode_pod():
    """--max-prefill-backlog 1: the second of two sessions arriving together finds the prefill
    pod with a turn in flight and prefills whole on the least-loaded decode pod; with no limit
    both go P/D."""
    trace = sessions_from([{"session_id": f"s{i}", "start_s": 0.0, "turns": [
        {"input": {"length": 1000}, "output_tokens": 4}]} for i in range(2)], block_size=256)
    pods = _pods_by_turn(trace, local_prefill_tokens=2048, max_prefill_backlog=1)
    assert pods[0][0] == "prefill-0" and pods[1][0] == pods[1][1] != "prefill-0"
    assert [p for p, _ in _pods_by_turn(trace, local_prefill_tokens=2048)] == ["prefill-0"] * 2


def test_handoff_overhead_is_cpu_work_on_a_shared_host():
    """On one core, session A's hand-off carries 0.5 s of work besides its 1 ms of bytes; B
    prefills on the prefill pod meanwhile, so both run at half speed until the pull is done:
    A's turn ends 2 x 0.501 s after its prefill, and B's prefill takes 0.5 s longer."""
    trace = sessions_from([{"session_id": s, "start_s": t, "turns": [
        {"input": {"length": 1000}, "output_tokens": 1}]} for s, t in (("a", 0.0), ("b", 1.3))])

    def run(overhead: float):
        res = simulate(compile_trace(trace), toy(host_cores=1), SimConfig(
            config="agentserving", topology="1P1D", engine_scheduler=True,
            handoff_overhead_s=overhead))
        return {r["session_id"]: r["e2e_s"] for r in res.records}, \
            res.summary["sim"]["forward_s_by_role"]["prefill"]

    (e2e0, fwd0), (e2e1, fwd1) = run(0.0), run(0.5)
    assert e2e0["a"] == pytest.approx(1.3 + 2 * 0.001)
    assert e2e1["a"] == pytest.approx(1.3 + 2 * 0.501)
    assert fwd1 - fwd0 == pytest.approx(0.5)


def test_across_runs_summarizes_errors_and_the_real_spread():
    from agentserving.sim.validate import across_runs

    def run(real: float, sim: float) -> dict:
        m = {"real": real, "sim": sim, "error": (sim - real) / real}
        return {"configs": {"agentserving": {"fitted": {"req_per_s": m, "e2e_p95_s": m}}}}

    out = across_runs([run(2.0, 1.8), run(2.4, 1.8)])
    p95 = out["agentserving"]["e2e_p95_s"]
    assert out["runs"] == 2 and out["runs_within_15pct"] == 1   # -10% passes, -25% does not
    assert p95["error_min"] == pytest.approx(-0.25) and p95["error_max"] == pytest.approx(-0.1)
    assert p95["real_mean"] == pytest.approx(2.2)
    assert p95["error_of_means"] == pytest.approx(1.8 / 2.2 - 1)


def test_check_steps_prices_logged_steps_with_the_profile(tmp_path):
    """Two logged steps priced by the toy profile (prefill 0.1 s + 1 ms/token, decode 10 ms a
    step): a 512-token chunk beside one decode costs 0.1 + 0.512 + 0.01; a decode-only step
    0.01. The CLI reads a folder of logs and reports CPU / price and wall / CPU."""
    import json

    from click.testing import CliRunner

    from agentserving.sim.cli import command
    from agentserving.sim.steps import price_steps

    steps = [{"role": "decode", "chunks": [[0, 512]], "decode_tokens": 1,
              "decode_context": 900, "cpu_s": 0.6, "forward_s": 1.2, "exposed_kv_s": 0.0},
             {"role": "decode", "chunks": [], "decode_tokens": 2, "decode_context": 1800,
              "cpu_s": 0.02, "forward_s": 0.02, "exposed_kv_s": 0.0}]
    out = price_steps(toy(), steps)
    assert out["prefill"]["price_s"] == pytest.approx(0.622)
    assert out["prefill"]["wall_over_cpu"] == pytest.approx(2.0)
    assert out["decode"]["cpu_over_price"] == pytest.approx(2.0)
    (tmp_path / "pod-0.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    prof = tmp_path / "toy.yaml"
    from agentserving.sim.profile import write_profile
    write_profile(toy(), prof)
    folded = tmp_path / "folded.yaml"
    res = CliRunner().invoke(command, ["check-steps", str(tmp_path), "--profile", str(prof),
                                       "--fold-into", str(folded)])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output[:res.output.rindex("}") + 1])
    assert report["pod-0"]["decode"]["steps"] == 1
    # the decode role's steps cost 0.62 s of CPU for 0.632 s of price
    assert report["step_cost_factor"] == {"decode": pytest.approx(0.62 / 0.632, abs=1e-3)}
    assert load_profile(folded).step_cost_factor == report["step_cost_factor"]
    empty = tmp_path / "none"
    empty.mkdir()
    res = CliRunner().invoke(command, ["check-steps", str(empty)])
    assert res.exit_code == 2 and "no *.jsonl step logs" in res.output


def test_step_cost_factor_scales_a_roles_forward_work():
    """A factor of 2 on the baseline pods' role doubles the hand-computed step times of
    test_engine_fcfs_steps_hand_computed (3 prefill passes + 10 decode steps: 1.4 s -> 2.8 s)."""
    trace = sessions_from([{"session_id": "s", "start_s": 0.0, "turns": [
        {"input": {"length": 1000}, "output_tokens": 11}]}])
    res = simulate(compile_trace(trace), toy(step_cost_factor={"both": 2.0}),
                   SimConfig(config="baseline", topology="1x1", engine_scheduler=True))
    (rec,) = res.records
    assert rec["ttft_s"] == pytest.approx(2 * 1.3)
    assert res.summary["sim"]["forward_s"] == pytest.approx(2.8)
