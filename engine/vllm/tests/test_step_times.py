"""The step clock: KV wait on a step's critical path vs its forward, from the connector's calls.

Pure (a fake clock); the connector's calls on a real vLLM pod are driven by
e2e/vllm/test_vllm_fleet.py::test_restore_from_every_tier_equals_recompute."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from agentserving.engine.vllm.step_times import (
    StepClock,
    merge_summaries,
    pooled,
    prometheus_observer,
)
from testkit.clock import ManualClock


def _step(clock: StepClock, fake: ManualClock, *, loads: int, waits: list[float],
          forward: float, layerwise: bool = False) -> None:
    clock.begin(loads=loads)
    for w in waits:  # e.g. one synchronous retrieve, or one wait per layer
        with clock.timed():
            fake.now += w
            if layerwise:
                clock.layer_waited()
    fake.now += forward
    clock.end()


def test_a_step_splits_into_its_kv_wait_and_its_forward() -> None:
    fake = ManualClock()
    seen = []
    clock = StepClock(clock=fake, on_step=seen.append)
    _step(clock, fake, loads=1, waits=[0.2], forward=1.0)  # a synchronous reload
    _step(clock, fake, loads=2, waits=[0.01] * 4, forward=2.0,
          layerwise=True)  # layer-wise: four short waits
    _step(clock, fake, loads=0, waits=[0.0], forward=0.05)  # a decode step
    assert [(round(s.kv_wait_s, 6), round(s.forward_s, 6), s.loads, s.layer_waits)
            for s in seen] == [(0.2, 1.0, 1, 0), (0.04, 2.0, 2, 4), (0.0, 0.05, 0, 0)]
    s = clock.summary()
    assert s["steps"] == 3 and s["loading_steps"] == 2 and s["last_step"] == 3
    assert s["layerwise_steps"] == 1  # the second step's KV came layer by layer
    assert s["kv_wait_exposed_p50_s"] == pytest.approx(0.12)  # loading steps only
    assert s["forward_p50_s"] == pytest.approx(1.5)
    assert s["kv_wait_share_p50"] == pytest.approx(0.08)
    assert s["loading"] == [[0.2, 1.0], [0.04, 2.0]]


def test_since_keeps_only_the_steps_that_came_after() -> None:
    fake = ManualClock()
    clock = StepClock(clock=fake)
    _step(clock, fake, loads=1, waits=[1.0], forward=1.0)
    mark = clock.summary()["last_step"]
    _step(clock, fake, loads=0, waits=[], forward=0.1)
    later = clock.summary(since=mark)
    assert later["steps"] == 1 and later["loading_steps"] == 0
    assert later["kv_wait_exposed_p50_s"] is None and later["kv_wait_share_p50"] is None


def test_a_save_without_a_step_is_not_a_step() -> None:
    clock = StepClock(clock=ManualClock())
    assert clock.end() is None and clock.summary()["steps"] == 0


def test_pods_pool_their_loading_steps_and_a_pod_takes_its_slowest_rank() -> None:
    fake = ManualClock()
    a, b = StepClock(clock=fake), StepClock(clock=fake)
    _step(a, fake, loads=1, waits=[0.1], forward=1.0)
    _step(b, fake, loads=1, waits=[0.3], forward=1.0)
    _step(b, fake, loads=1, waits=[0.5], forward=1.0, layerwise=True)
    both = pooled(iter([a.summary(), b.summary()]))  # any iterable, read once
    assert both["loading_steps"] == 3 and both["kv_wait_exposed_p50_s"] == pytest.approx(0.3)
    assert both["layerwise_steps"] == 1 and both["steps"] == 3
    assert merge_summaries([a.summary(), b.summary()])["kv_wait_total_s"] == pytest.approx(0.8)
    assert merge_summaries([]) is None


def test_steps_feed_prometheus_histograms_by_whether_they_loaded() -> None:
    registry = CollectorRegistry()
    fake = ManualClock()
    clock = StepClock(clock=fake, on_step=prometheus_observer(registry))
    _step(clock, fake, loads=1, waits=[0.2], forward=1.0)
    _step(clock, fake, loads=0, waits=[], forward=0.5)
    name = "agentserving_vllm_step_kv_wait_seconds"
    assert registry.get_sample_value(f"{name}_count", {"loads": "yes"}) == 1
    assert registry.get_sample_value(f"{name}_sum", {"loads": "yes"}) == pytest.approx(0.2)
    assert registry.get_sample_value("agentserving_vllm_step_forward_seconds_sum",
                                     {"loads": "no"}) == pytest.approx(0.5)


def test_the_connector_counts_the_requests_a_step_loads() -> None:
    from agentserving.engine.vllm.step_times import loading_requests

    def req(can_load: bool | None) -> SimpleNamespace:
        return SimpleNamespace(load_spec=None if can_load is None
                               else SimpleNamespace(can_load=can_load))

    meta = SimpleNamespace(requests=[req(True), req(False), req(None), req(True)])
    assert loading_requests(meta) == 2
    assert loading_requests(SimpleNamespace()) == 0
