"""Fixtures of the replay tests: the fake completions server (agentserving.replay.testing)
on a loopback port, and small synthetic traces."""

from __future__ import annotations

import pytest

from agentserving.replay.fake_server import FakeState, make_fake_app
from agentserving.replay.synthetic import LogNormal, SyntheticConfig, ToolSpec, generate
from testkit.servers import ThreadedServer


@pytest.fixture
def fake_server():
    state = FakeState()
    server = ThreadedServer(make_fake_app(state))
    server.state = state  # type: ignore[attr-defined]
    try:
        yield server
    finally:
        server.stop()


def make_small_trace(sessions: int = 4, seed: int = 1, gap: float = 0.05):
    """A few 3-4 turn sessions over 16-token blocks, each with a one-turn branch."""
    return generate(SyntheticConfig(
        name="test", sessions=sessions, seed=seed, block_size=16, arrival_rate=None,
        agents=[{"name": "coder", "system_blocks": 2}],
        turns=LogNormal(median=3, sigma=0.2, lo=3, hi=4),
        task_tokens=LogNormal(median=20, sigma=0.3, lo=5, hi=40),
        output_tokens=LogNormal(median=6, sigma=0.3, lo=3, hi=10),
        tools=[ToolSpec(name="bash", weight_early=1, weight_late=1,
                        result_tokens=LogNormal(median=30, sigma=0.3, lo=10, hi=60),
                        run_s=LogNormal(median=gap, sigma=0, lo=0, hi=1))],
        branch_probability=1.0, branch_turns=LogNormal(median=1, sigma=0, lo=1, hi=1)))


@pytest.fixture
def small_trace():
    return make_small_trace
