"""The replay client against a real HTTP server that speaks the completions SSE format."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict

import pytest
from click.testing import CliRunner

from agentserving.replay.client import Replayer, ReplayOptions, token_digest
from agentserving.replay.trace import resolve_all, sessions_from, write_trace


def run(trace, server, tmp_path=None, **kw):
    opts = ReplayOptions(target=server.url, progress=False, chunk_size=16, **kw)
    return asyncio.run(Replayer(trace, opts, out_dir=tmp_path).run())


def sent(server):
    """What the server received: (session, nth request) -> (prompt, forced, max_tokens)."""
    return {(r["session"], r["nth"]): (tuple(r["body"]["prompt"]),
                                       tuple(r["body"]["forced_output_token_ids"]),
                                       r["body"]["max_tokens"])
            for r in server.state.requests}


def test_teacher_forcing_sends_identical_tokens(fake_server, tmp_path, small_trace):
    trace = small_trace()
    first = run(trace, fake_server, tmp_path / "a")
    received_once = sent(fake_server)
    fake_server.state.reset()
    second = run(trace, fake_server, tmp_path / "b")
    assert sent(fake_server) == received_once
    assert len(received_once) == trace.num_turns
    assert [r.prompt_digest for r in sorted(first.records, key=lambda r: (r.session_id, r.turn))] \
        == [r.prompt_digest for r in sorted(second.records, key=lambda r: (r.session_id, r.turn))]

    # the server saw prompt[k+1] = prompt[k] + forced[k] + input[k+1], as the trace says
    expected = {(t.session_id, t.index): (tuple(t.prompt), tuple(t.forced_output))
                for rs in resolve_all(trace) for t in rs.turns}
    for (sid, k), (prompt, forced, max_tokens) in received_once.items():
        assert (prompt, forced) == expected[(sid, k)]
        assert max_tokens == len(forced)
        if k > 0:
            prev_prompt, prev_forced, _ = received_once[(sid, k - 1)]
            assert prompt[: len(prev_prompt) + len(prev_forced)] == prev_prompt + prev_forced
    bodies = fake_server.state.requests
    assert all(b["body"]["stream"] is True and b["body"]["model"] == "fake-model"
               for b in bodies)
    tools = {(t.session_id, t.index): t.tool for rs in resolve_all(trace) for t in rs.turns}
    assert {(b["session"], b["nth"]): b["tool"] for b in bodies} == tools
    assert any(tools.values()) and not all(tools.values())
    branch_requests = [b for b in bodies if ".b" in b["session"]]
    assert branch_requests and all(b["parent"] == b["session"].split(".b")[0]
                                   for b in branch_requests)


def test_records_metrics_cache_and_routing(fake_server, tmp_path, small_trace):
    trace = small_trace()
    fake_server.state.token_delay_s = 0.01
    result = run(trace, fake_server, tmp_path)
    recs = result.records
    assert all(r.ok for r in recs) and len(recs) == trace.num_turns
    later = [r for r in recs if r.turn > 0]
    assert all(r.cached_tokens > 0 for r in later)  # the previous turn's KV was reused
    assert all(r.cached_reported and r.prompt_tokens > r.cached_tokens for r in recs)
    assert all(r.prefill_pod == "fake-prefill-0" and r.decode_pod == "fake-decode-0"
               for r in recs)
    assert all(r.completion_tokens == r.forced_tokens and not r.forced_mismatch for r in recs)
    assert all(r.n_chunk_hashes == r.prompt_tokens // 16 for r in recs)
    for r in recs:
        assert len(r.itl_s) == r.forced_tokens - 1
        # the server waits 10 ms before each token (the client may see a few bunched)
        assert r.ttft_s > 0.008 and sum(r.itl_s) > 0.007 * len(r.itl_s)
        assert r.e2e_s >= r.ttft_s + sum(r.itl_s) - 1e-6
    s = result.summary
    assert s["success_rate"] == 1.0 and s["turns_completed"] == trace.num_turns
    # an unbounded cache on the server: the measured hit rate is the trace's ideal
    assert s["prefix_hit_rate"] == pytest.approx(s["ideal_hit_rate"], abs=0.02)
    assert s["ideal_hit_rate"] > 0.3
    assert sum(r.cached_tokens for r in recs) == pytest.approx(
        sum(r.ideal_cached_tokens for r in recs), rel=0.05)
    assert s["itl_p99_s"] >= 0.005 and s["e2e_p95_s"] >= s["e2e_p50_s"] > 0
    assert s["req_per_s"] == pytest.approx(len(recs) / s["makespan_s"])
    lines = (tmp_path / "turns.jsonl").read_text().splitlines()
    assert len(lines) == len(recs) and json.loads(lines[0])["session_id"]
    assert json.loads((tmp_path / "summary.json").read_text())["turns_completed"] == len(recs)


@pytest.mark.parametrize("tool_gap_scale", [1.0, 2.0])
def test_a_turn_starts_after_the_previous_one_and_its_tool_gap(fake_server, small_trace,
                                                                tool_gap_scale):
    trace = small_trace(sessions=3, gap=0.2)
    result = run(trace, fake_server, time_scale=0.5, tool_gap_scale=tool_gap_scale)
    scale = 0.5 * tool_gap_scale
    by_session = defaultdict(list)
    for r in result.records:
        by_session[r.session_id].append(r)
    gaps = {(t.session_id, t.index): t.tool_gap_s for rs in resolve_all(trace) for t in rs.turns}
    for sid, recs in by_session.items():
        recs.sort(key=lambda r: r.turn)
        for a, b in zip(recs, recs[1:], strict=False):
            waited = b.start_s - a.end_s
            assert waited >= gaps[(sid, a.turn)] * scale - 0.005
            assert waited < gaps[(sid, a.turn)] * scale + 0.15
            assert b.gap_before_s == pytest.approx(gaps[(sid, a.turn)] * scale if a.tool
                                                   else 0.0)
    # branches start after their parent's fork turn
    for s in trace.sessions:
        if s.parent:
            fork = next(r for r in by_session[s.parent.session_id] if r.turn == s.parent.turn)
            assert by_session[s.session_id][0].start_s >= fork.end_s


def test_failed_turn_ends_its_session(fake_server, small_trace):
    trace = small_trace(sessions=3)
    fake_server.state.fail.add(("s1", 1))
    result = run(trace, fake_server)
    s1 = sorted((r for r in result.records if r.session_id == "s1"), key=lambda r: r.turn)
    assert [r.ok for r in s1] == [True, False]
    assert s1[1].status_code == 500 and "injected failure" in s1[1].error
    # s1's later turns were never sent; branches forking at or after turn 1 neither
    assert max(r["nth"] for r in fake_server.state.requests if r["session"] == "s1") == 1
    s = result.summary
    total_sessions = len(trace.sessions)
    s1_branch_turn = next(x.parent.turn for x in trace.sessions
                          if x.parent and x.parent.session_id == "s1")
    failed_sessions = 1 + (1 if s1_branch_turn >= 1 else 0)
    assert s["success_rate"] == pytest.approx((total_sessions - failed_sessions) / total_sessions)
    assert s["turns_failed"] == 1 and s["turns_not_sent"] > 0
    assert s["turns_completed"] == trace.num_turns - 1 - s["turns_not_sent"]
    assert list(s["errors"]) == ["HTTP 500: injected failure"]


def test_unreachable_target_fails_every_session(tmp_path, small_trace):
    from testkit.servers import free_port

    trace = small_trace(sessions=2)
    opts = ReplayOptions(target=f"http://127.0.0.1:{free_port()}", progress=False,
                         model="m", request_timeout_s=2)
    result = asyncio.run(Replayer(trace, opts).run())
    assert result.summary["success_rate"] == 0.0 and result.summary["turns_completed"] == 0
    assert all("ConnectError" in r.error for r in result.records)


def test_arrivals_poisson_seeded_or_from_timestamps(small_trace):
    trace = small_trace(sessions=200)
    opts = ReplayOptions(target="http://x", rate=4.0, seed=5, progress=False)
    a = Replayer(trace, opts).arrivals()
    assert a == Replayer(trace, opts).arrivals()
    assert a != Replayer(trace, ReplayOptions(target="http://x", rate=4.0, seed=6)).arrivals()
    assert len(a) == 200 and max(a.values()) == pytest.approx(200 / 4.0, rel=0.2)
    timed = sessions_from([
        {"session_id": "x", "start_s": 10.0, "turns": [{"input": {"length": 3},
                                                        "output_tokens": 1}]},
        {"session_id": "y", "start_s": 14.0, "turns": [{"input": {"length": 3},
                                                        "output_tokens": 1}]}])
    arr = Replayer(timed, ReplayOptions(target="http://x", time_scale=0.5)).arrivals()
    assert arr == {"x": 0.0, "y": 2.0}


def test_turn_timestamps_are_honoured_and_scaled(fake_server):
    trace = sessions_from([{"session_id": "m", "start_s": 100.0, "turns": [
        {"input": {"length": 20}, "output_tokens": 2, "timestamp_s": 100.0,
         "context": "replace"},
        {"input": {"length": 20}, "output_tokens": 2, "timestamp_s": 101.0,
         "context": "replace"}]}], block_size=16)
    result = run(trace, fake_server, time_scale=0.3)
    t0, t1 = sorted(result.records, key=lambda r: r.turn)
    assert t1.start_s - t0.start_s == pytest.approx(0.3, abs=0.08)


def test_max_active_sessions_limits_concurrency(fake_server, small_trace):
    trace = small_trace(sessions=4, gap=0.001)
    fake_server.state.token_delay_s = 0.005
    result = run(trace, fake_server, max_active_sessions=1)
    spans = defaultdict(lambda: [float("inf"), 0.0])
    for r in result.records:  # a branch is a session of its own: it waits for a slot too
        spans[r.session_id][0] = min(spans[r.session_id][0], r.start_s)
        spans[r.session_id][1] = max(spans[r.session_id][1], r.end_s)
    ordered = sorted(spans.values())
    assert len(ordered) == len(trace.sessions)
    assert all(b[0] >= a[1] - 1e-3 for a, b in zip(ordered, ordered[1:], strict=False))
    assert result.summary["success_rate"] == 1.0


def test_cli_writes_records_and_summary(fake_server, tmp_path, small_trace):
    from agentserving.core.cli import main

    trace_path = write_trace(small_trace(sessions=2), tmp_path / "t.jsonl")
    out = tmp_path / "run"
    res = CliRunner().invoke(main, ["replay", "--trace", str(trace_path), "--target",
                                    fake_server.url, "--out", str(out), "--no-progress",
                                    "--rate", "50", "--limit", "1", "--chunk-size", "16"],
                             env={"AGENTSERVING_REPLAY_API_KEY": "k1"})
    assert res.exit_code == 0, res.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sessions_planned"] == 2  # session s0 and its branch
    assert summary["success_rate"] == 1.0 and summary["replay"]["rate"] == 50
    assert '"prefix_hit_rate"' in res.output
    assert {r["auth"] for r in fake_server.state.requests} == {"Bearer k1"}  # from the env
    fake_server.state.reset()
    fake_server.state.fail.add(("s0", 0))
    res = CliRunner().invoke(main, ["replay", "--trace", str(trace_path), "--target",
                                    fake_server.url, "--out", str(out), "--no-progress"])
    assert res.exit_code == 1 and "failed" in res.output
    help_text = CliRunner().invoke(main, ["replay", "--help"]).output
    assert "AGENTSERVING_REPLAY_TIME_SCALE" in help_text and "--timestamps" in help_text


def test_prompt_digest_is_of_the_tokens():
    assert token_digest([1, 2, 3]) == token_digest([1, 2, 3]) != token_digest([1, 2, 4])


def _sourced_trace():
    usage = {"prompt_tokens": 90, "prompt_cache_hit_tokens": 60, "completion_tokens": 7}
    return sessions_from([
        {"session_id": "swe", "meta": {"source": "mini-swe-agent"}, "turns": [
            {"input": {"length": 40}, "output_tokens": 4, "meta": {"usage": usage}},
            {"input": {"length": 20}, "output_tokens": 3, "meta": {"usage": usage}}]},
        {"session_id": "chat", "meta": {"source": "mooncake"}, "turns": [
            {"input": {"length": 30}, "output_tokens": 2}]},
        {"session_id": "plain", "turns": [{"input": {"length": 10}, "output_tokens": 2}]},
    ], block_size=16)


def test_records_and_summary_by_source(fake_server, tmp_path):
    result = run(_sourced_trace(), fake_server, tmp_path)
    recs = {(r.session_id, r.turn): r for r in result.records}
    assert recs[("swe", 1)].source == "mini-swe-agent" and recs[("plain", 0)].source is None
    assert (recs[("swe", 0)].reference_prompt_tokens,
            recs[("swe", 0)].reference_cached_tokens) == (90, 60)
    assert recs[("chat", 0)].reference_prompt_tokens is None
    by_source = result.summary["by_source"]
    assert set(by_source) == {"mini-swe-agent", "mooncake"}  # unlabelled turns stay out
    swe = by_source["mini-swe-agent"]
    assert swe["turns"] == 2 and swe["reference_hit_rate"] == pytest.approx(60 / 90)
    # swe turn 1 (40 + 4 + 20 tokens) reuses the 2 whole 16-token chunks turn 0 computed
    # (its prompt and all but its last output token: 43 tokens)
    assert swe["ideal_hit_rate"] == pytest.approx(32 / (40 + 64))
    assert swe["prefix_hit_rate"] == pytest.approx(swe["ideal_hit_rate"])  # unbounded cache
    assert swe["ideal_vs_reference"] == pytest.approx(swe["ideal_hit_rate"] / (60 / 90))
    assert "reference_hit_rate" not in by_source["mooncake"]
    assert by_source["mooncake"]["e2e_p95_s"] > 0
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["by_source"]["mini-swe-agent"]["turns"] == 2


def test_forced_outputs_are_checked_by_their_ids(fake_server):
    fake_server.state.stray.add(("swe", 1))
    result = run(_sourced_trace(), fake_server)
    assert all(r["body"]["return_token_ids"] is True for r in fake_server.state.requests)
    mismatched = [(r.session_id, r.turn) for r in result.records if r.forced_mismatch]
    assert mismatched == [("swe", 1)] and result.summary["forced_mismatches"] == 1
    # a server that sends no ids back is checked by the count alone: the stray id passes
    fake_server.state.reset()
    fake_server.state.token_ids = False
    result = run(_sourced_trace(), fake_server)
    assert not any(r.forced_mismatch for r in result.records)


def test_a_turns_pause_and_a_branchs_start_reach_the_records(fake_server):
    trace = sessions_from([
        {"session_id": "p", "turns": [
            {"input": {"length": 40}, "output_tokens": 2, "tool_gap_s": 0.05},
            {"input": {"length": 8}, "output_tokens": 2, "meta": {"pause": "human"}}]},
        {"session_id": "p/sub-0", "parent": {"session_id": "p", "turn": 0},
         "turns": [{"input": {"length": 8}, "output_tokens": 2}]}], block_size=16)
    result = run(trace, fake_server)
    by = {(r.session_id, r.turn): r for r in result.records}
    assert by[("p", 1)].pause == "human" and by[("p", 0)].pause is None
    assert result.summary["after_human_pause_turns"] == 1
    assert result.summary["branch_starts"] == 1 and by[("p/sub-0", 0)].parent_session_id == "p"
    assert result.summary["branch_start_ttft_p90_s"] == by[("p/sub-0", 0)].ttft_s
    spans = [by[("p", 1)].end_s - by[("p", 0)].start_s,  # p's turns and the pause between
             by[("p/sub-0", 0)].end_s - by[("p/sub-0", 0)].start_s]
    assert spans[0] > 0.05 and result.summary["mean_jct_s"] == pytest.approx(sum(spans) / 2)
