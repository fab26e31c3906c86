"""``agentserving worker --chunk-align N`` reaches the prefill policy, and the alignment rule
holds for what the policy plans under the engine's executor rules."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentserving.engine.cli import command
from agentserving.engine.scheduler.registry import make_policy
from agentserving.engine.settings import WorkerSettings
from agentserving.prefill.policies import FcfsChunk, LongcapDynamic, ReqView, SchedState, advance


def _settings(argv: list[str]) -> WorkerSettings:
    ctx = command.make_context("worker", argv)  # parses the flags, runs nothing
    return WorkerSettings(**ctx.params)


def test_flag_reaches_the_policy_through_the_settings():
    s = _settings(["--chunk-align", "128", "--scheduler-policy", "longcap-dynamic?lookahead=2"])
    assert s.chunk_align == 128
    pol = make_policy(s.scheduler_policy, s.prefill_chunk_tokens)
    assert pol.pure.chunk_align == 128 and pol.shadow is not None
    # the engine's own fcfs takes (and ignores) the option; no flag: nothing added
    assert make_policy(_settings(["--chunk-align", "128"]).scheduler_policy, 512).name == "fcfs"
    assert _settings([]).scheduler_policy == "fcfs"
    # settings re-validated in the engine process keep the same spec (idempotent)
    again = WorkerSettings(**s.model_dump())
    assert again.scheduler_policy == s.scheduler_policy


def test_conflicting_or_negative_align_is_rejected_naming_the_field():
    with pytest.raises(ValueError, match="chunk_align"):
        WorkerSettings(chunk_align=128, scheduler_policy="shadow?chunk_align=64")
    with pytest.raises(ValueError, match="chunk_align"):
        WorkerSettings(chunk_align=-1)


@settings(max_examples=80, deadline=None)
@given(prompt=st.integers(1, 20000), cached=st.integers(0, 19999),
       budget=st.integers(128, 9000), quantum=st.sampled_from([1, 256]),
       split_tail=st.booleans(), which=st.integers(0, 1))
def test_every_non_final_chunk_ends_on_the_alignment(prompt, cached, budget, quantum,
                                                      split_tail, which):
    cached = min(cached, prompt - 1)
    budget = max(budget, quantum)  # the engine's chunk budget is a multiple of its quantum
    pol = (FcfsChunk(chunk_tokens=budget, chunk_align=128) if which == 0 else
           LongcapDynamic(step_tokens=max(budget, 256), min_chunk=min(256, max(budget, 256)),
                          chunk_align=128))
    s = SchedState((ReqView("r", 0.0, prompt, computed=cached),), (), quantum=quantum,
                   split_tail=split_tail)
    ends = []
    for _ in range(10000):
        d = pol.decide(s)
        if not d.prefill:
            break
        (rid, n), = d.prefill
        view = (s.running + s.waiting)[0]
        ends.append((view.computed + n, view.computed + n == prompt))
        s = advance(s, d)
        if not s.running and not s.waiting:
            break
    assert ends and ends[-1] == (prompt, True)  # the prompt completes
    for end, final in ends[:-1]:
        # (the engine's quantum, 256, is a multiple of 128: its split tail is aligned too)
        assert not final and end % 128 == 0 and end % quantum == 0


def test_a_chunk_smaller_than_the_alignment_is_refused():
    with pytest.raises(ValueError, match="chunk_align"):
        FcfsChunk(chunk_tokens=64, chunk_align=128)
    with pytest.raises(ValueError, match="chunk_align"):
        LongcapDynamic(step_tokens=1024, min_chunk=64, chunk_align=128)


def test_cost_and_shadow_options_parse_from_the_policy_spec():
    spec = ("shadow?short_order=cost&context_cost=0.08&attention_cost=0.0001&shorts_per_step=1"
            "&step_cost=3072&robust=0.5&commit=1&lookahead=3")
    pol = make_policy(spec, 256)
    assert isinstance(pol.pure, LongcapDynamic) and pol.pure.short_order == "cost"
    assert pol.pure.attention_cost == 0.0001 and pol.pure.step_cost == 3072.0
    assert pol.pure.shorts_per_step == 1
    assert pol.shadow.robust == 0.5 and pol.shadow.commit and pol.shadow.lookahead == 3
    plain = make_policy("shadow", 256)
    assert plain.shadow.robust == 0.0 and not plain.shadow.commit
