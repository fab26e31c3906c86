"""The vLLM scheduler glue: against a stand-in with vLLM's loop shape, and (when the test-only
vLLM env of ``scripts/vllm-test-env.sh`` is installed) against vLLM's real ``Scheduler`` class
in a child process. What is and is not exercised: see ``vllm_plugin``'s docstring."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

import pytest

from agentserving.prefill import vllm_plugin
from agentserving.prefill.policies import LongcapDynamic, ReqView, SchedState
from testkit.vllm_env import vllm_env_dir


@dataclasses.dataclass(eq=False)
class FakeRequest:
    request_id: str
    arrival_time: float
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    kv_transfer_params: dict | None = None


class FCFSQueue(deque):
    pass


class StandIn:
    """vLLM v1 ``Scheduler.schedule``'s shape, reduced to what the glue touches: running
    requests first (chunk = min(left, budget), clip hook, 0 -> skip), then the waiting
    requests that hold KV blocks (``kv_holding_waiting``), then the FCFS waiting queue, each
    popped from the head (clip hook, 0 -> stop admitting)."""

    def __init__(self, budget: int, num_gpu_blocks: int = 1 << 20, block_size: int = 16):
        self.max_num_scheduled_tokens = budget
        self.max_num_running_reqs = 8
        self.block_size = block_size
        self.cache_config = type("C", (), {"num_gpu_blocks": num_gpu_blocks})()
        self.need_mamba_block_aligned_split = False
        self.waiting: FCFSQueue = FCFSQueue()
        self.kv_holding_waiting: FCFSQueue = FCFSQueue()
        self.running: list[FakeRequest] = []

    def _mamba_block_aligned_split(self, request, num_new_tokens, *args):
        raise AssertionError("no Mamba layers here: vLLM's split must not run")

    def schedule(self):
        budget, out = self.max_num_scheduled_tokens, {}
        for r in self.running:
            n = min(r.num_prompt_tokens - r.num_computed_tokens, budget)
            if self.need_mamba_block_aligned_split:
                n = self._mamba_block_aligned_split(r, n)
            if n <= 0:
                continue
            out[r.request_id] = n
            budget -= n
        while budget > 0 and len(self.running) < self.max_num_running_reqs:
            queue = self.kv_holding_waiting or self.waiting
            if not queue:
                break
            r = queue[0]
            n = min(r.num_prompt_tokens - r.num_computed_tokens, budget)
            if self.need_mamba_block_aligned_split:
                n = self._mamba_block_aligned_split(r, n, 0, 0)
            if n == 0:
                break
            queue.popleft()
            self.running.append(r)
            out[r.request_id] = n
            budget -= n
        for r in self.running:
            r.num_computed_tokens += out.get(r.request_id, 0)
        self.running = [r for r in self.running if r.num_computed_tokens < r.num_prompt_tokens]
        return out


def test_the_subclass_schedules_exactly_what_the_policy_decides(monkeypatch):
    monkeypatch.setenv(vllm_plugin.POLICY_ENV, "longcap-dynamic?step_tokens=2048&"
                       "short_tokens=1024&min_chunk=256&short_step=1024&short_order=shortest")
    cls = vllm_plugin.make_scheduler_cls(StandIn)
    sched = cls(budget=8192)
    assert sched.need_mamba_block_aligned_split is True
    policy = LongcapDynamic(step_tokens=2048, short_tokens=1024, min_chunk=256, short_step=1024,
                            short_order="shortest")
    reqs = [FakeRequest("long", 0.0, 9000), FakeRequest("a", 1.0, 700),
            FakeRequest("b", 2.0, 300), FakeRequest("c", 3.0, 5000)]
    sched.waiting.extend(reqs)
    steps = 0
    while sched.waiting or sched.running:
        wait, run = vllm_plugin.views_from_vllm(sched.waiting, sched.running)
        want = policy.decide(SchedState(wait, run, max_running=8,
                                        kv_capacity_tokens=(1 << 20) * 16, block_size=16))
        got = sched.schedule()
        assert got == dict(want.prefill), f"step {steps}"
        steps += 1
        assert steps < 100
    # vLLM alone would have run the 9000-token head first with an 8192 budget; the policy ran
    # the shortest short first and capped the long band
    assert steps > 5
    assert sched._grants is None  # outside schedule(), vLLM's own chunks are untouched
    r = FakeRequest("x", 0.0, 100)
    assert sched._mamba_block_aligned_split(r, 77) == 77


def test_order_waiting_and_clip():
    reqs = [FakeRequest(x, i, 100) for i, x in enumerate("abcd")]
    d = vllm_plugin.Decision(prefill=(("c", 50), ("a", 100)), admit=("c", "a"))
    assert [r.request_id for r in vllm_plugin.order_waiting(reqs, d)] == ["c", "a", "b", "d"]
    g = vllm_plugin.budgets(d)
    assert vllm_plugin.clip(g, reqs[2], 80) == 50
    assert vllm_plugin.clip(g, reqs[1], 80) == 0
    decoding = FakeRequest("z", 0, 10, num_computed_tokens=10)
    assert vllm_plugin.clip(g, decoding, 1) == 1
    assert vllm_plugin.views_from_vllm([reqs[0]], [])[0] == (ReqView("a", 0.0, 100),)


def test_missing_vllm_is_a_clear_error_only_on_construction():
    cls = vllm_plugin.make_scheduler_cls(vllm_plugin.vllm_scheduler_base())
    if "VllmMissing" not in cls.__name__:
        pytest.skip("vLLM importable in this interpreter")
    with pytest.raises(ImportError, match="needs vLLM"):
        cls()


def test_vllms_real_scheduler_schedules_what_the_policy_decides(tmp_path):
    env = vllm_env_dir()
    if env is None:
        pytest.skip("vLLM test env not installed (scripts/vllm-test-env.sh)")
    probe = Path(__file__).with_name("vllm_sched_probe.py")
    out = subprocess.run([sys.executable, str(probe), str(env), str(tmp_path)],
                         capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    rep = json.loads(out.stdout.strip().splitlines()[-1])
    assert rep["subclass"] and rep["flag"] is True
    assert rep["overrides"] == ["__init__", "_mamba_block_aligned_split", "schedule"]
    assert rep["split_params"][:3] == ["self", "request", "num_new_tokens"]
    steps = rep["steps"]
    assert rep["left"] == [0, 0] and len(steps) > 5  # every request ran to completion
    for i, st in enumerate(steps):
        assert st["vllm"] == st["policy"], f"step {i}"
    # not vLLM's own FCFS: the 9000-token head did not take the 8192-token step; the 40-token
    # turn that arrived last ran in the first step
    first = steps[0]["vllm"]
    assert first["long"] < 8192 and first["d"] == 40


def test_a_waiting_requests_cached_prefix_comes_from_the_schedulers_lookup():
    append = FakeRequest("append", 1.0, num_prompt_tokens=5000)  # 4,864 of them cached
    first = FakeRequest("first", 0.5, num_prompt_tokens=5000)  # nothing cached
    running = FakeRequest("run", 0.1, num_prompt_tokens=900, num_computed_tokens=300)
    cached = {"append": 4864}
    wait, run = vllm_plugin.views_from_vllm([append, first], [running],
                                            lambda r: cached.get(r.request_id, 0))
    assert [(v.req_id, v.computed) for v in wait] == [("append", 4864), ("first", 0)]
    assert run[0].computed == 300  # a running request's progress is vLLM's own
    assert [v.computed for v in vllm_plugin.views_from_vllm([append], [])[0]] == [0]
    # what it changes: the append is a short one, finished in this step beside the long
    # first turn; seen as 5,000 uncached tokens it would be a second long, left waiting
    policy = LongcapDynamic(step_tokens=2048, short_tokens=1024)

    def step(views):
        return dict(policy.decide(SchedState(views, (), max_running=8,
                                             kv_capacity_tokens=1 << 20, block_size=16)).prefill)
    assert step(wait) == {"first": 1912, "append": 136}
    assert "append" not in step(vllm_plugin.views_from_vllm([first, append], [])[0])


def test_a_request_holding_kv_blocks_is_planned_not_left_to_stall_the_pod(monkeypatch):
    """A decode pod running the policy: a P/D turn whose pulled KV landed (4,864 of its 5,000
    tokens computed) waits in vLLM's ``kv_holding_waiting``, which vLLM drains first. The
    policy plans it as started, so it gets its 136 tokens and the waiting first turn is
    admitted beside it; unseen, its chunk was clipped to 0 and nothing ran, step after step."""
    monkeypatch.setenv(vllm_plugin.POLICY_ENV, "longcap-dynamic?short_tokens=512")
    sched = vllm_plugin.make_scheduler_cls(StandIn)(budget=2048)
    sched.kv_holding_waiting.append(FakeRequest("pd", 1.0, 5000, num_computed_tokens=4864))
    sched.waiting.append(FakeRequest("first", 2.0, 3000))
    first_step = sched.schedule()
    assert first_step["pd"] == 136 and first_step.get("first", 0) > 0, first_step
    steps = 1
    while sched.waiting or sched.running or sched.kv_holding_waiting:
        assert sched.schedule(), f"step {steps} scheduled nothing"
        steps += 1
        assert steps < 50


def test_a_step_the_policy_would_leave_idle_is_vllms_own(monkeypatch):
    """A pod whose KV the policy's banker's check finds too full for any grant (a 1,000-token
    prompt, 320 tokens of blocks): the policy grants nothing; the step is vLLM's own pass, which
    preempts or chunks as it does without a policy, instead of an idle step, every step."""
    monkeypatch.setenv(vllm_plugin.POLICY_ENV, "longcap-dynamic")
    sched = vllm_plugin.make_scheduler_cls(StandIn)(budget=2048, num_gpu_blocks=20)
    sched.waiting.append(FakeRequest("big", 0.0, 1000))
    state = sched.glue.state(sched.waiting, sched.running)
    alone = sched.glue.policy.decide(state)
    assert alone.new_tokens == 0 and vllm_plugin.idles_the_pod(alone, state)
    assert sched.schedule() == {"big": 1000}
    assert sched.figures() == {"policy": "longcap-dynamic", "policy_steps": 1, "vllm_steps": 1}


def test_a_pd_turn_on_a_decode_pod_is_one_token_left_not_a_long_prefill():
    """A decode pod running Longcap: the P/D turn whose 5,000-token prompt the prefill pod
    computed (its KV pulled by the connector) is admitted in the first step with its last
    token, ahead of a local 3,000-token first turn; read as 5,000 uncached tokens it would be
    a second long one, left waiting behind the first."""
    pulled = FakeRequest("pd", 1.0, num_prompt_tokens=5000,
                         kv_transfer_params={"do_remote_prefill": True, "remote_host": "p0"})
    local = FakeRequest("local", 0.5, num_prompt_tokens=3000)
    done = FakeRequest("done", 0.2, num_prompt_tokens=3000,
                       kv_transfer_params={"do_remote_decode": True})  # a prefill pod's turn
    wait, _ = vllm_plugin.views_from_vllm([local, pulled, done], [])
    assert [(v.req_id, v.computed) for v in wait] == [("local", 0), ("pd", 4999), ("done", 0)]
    policy = LongcapDynamic(step_tokens=2048, short_tokens=512)
    plan = dict(policy.decide(SchedState(wait[:2], (), max_running=8,
                                         kv_capacity_tokens=1 << 20, block_size=16)).prefill)
    assert plan["pd"] == 1 and plan["local"] > 0


def test_the_policy_plans_vllms_step_budget_unless_told_otherwise(monkeypatch):
    monkeypatch.setenv(vllm_plugin.POLICY_ENV, "longcap-dynamic")
    assert vllm_plugin.policy_from_env("x", step_tokens=2048).step_tokens == 2048
    monkeypatch.setenv(vllm_plugin.POLICY_ENV, "longcap-dynamic?step_tokens=4096")
    assert vllm_plugin.policy_from_env("x", step_tokens=2048).step_tokens == 4096
    monkeypatch.setenv(vllm_plugin.POLICY_ENV, "fcfs-chunk?chunk_tokens=512")
    assert vllm_plugin.policy_from_env("x", step_tokens=2048).chunk_tokens == 512


def test_the_subclass_asks_vllms_prefix_cache_and_survives_its_absence():
    cls = vllm_plugin.make_scheduler_cls(StandIn)
    sched = cls(budget=2048)
    req = FakeRequest("r", 0.0, 5000)
    assert sched._cached_tokens(req) == 0  # the stand-in has no kv_cache_manager
    calls = []

    class Coordinator:
        def find_longest_cache_hit(self, hashes, max_length):
            calls.append((hashes, max_length))
            return ((), 4864, 0)

    sched.kv_cache_manager = type("M", (), {"coordinator": Coordinator()})()
    req.block_hashes, req.num_tokens = ["h0", "h1"], 5000
    assert sched._cached_tokens(req) == 4864 and calls == [(["h0", "h1"], 4999)]


def test_a_requests_wait_is_measured_on_the_states_clock():
    """vLLM stamps arrivals on the wall clock, the glue's ``now`` (and the announced turns'
    predicted arrivals) is the monotonic one: the views carry arrivals moved onto it, so a
    policy bounding a long turn's wait (``long_max_wait_s``) reads the real wait."""
    glue = vllm_plugin.PolicyGlue(LongcapDynamic(long_max_wait_s=3.0),
                                  kv_capacity_tokens=1 << 20, block_size=16, max_running=8)
    waited = FakeRequest("old", time.time() - 5.0, 6000)
    fresh = FakeRequest("new", time.time(), 6000)
    state = glue.state([waited, fresh], [])
    ages = {v.req_id: state.now - v.arrival for v in state.waiting}
    assert ages["old"] == pytest.approx(5.0, abs=0.5) and ages["new"] == pytest.approx(0, abs=0.5)
    assert glue.policy.overdue(state.waiting[0], state)
    assert not glue.policy.overdue(state.waiting[1], state)
