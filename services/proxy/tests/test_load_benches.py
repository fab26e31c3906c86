"""The load benches' judgements on hand-made figures: the soak's (``bench.soak_bench``: a
series that levels off is flat, one still climbing in the last third is growing, noise on
small numbers is not growth; what it samples of a process is real) and the concurrency
bench's knee (``bench.concurrency_bench``)."""

from __future__ import annotations

import argparse
import os

from testkit.servers import import_bench

soak = import_bench("soak_bench")
concurrency = import_bench("concurrency_bench")


class Load:
    turns, sessions, failed, errors = 300, 60, 0, {}


def run(series: dict[str, list[float]]) -> dict:
    n = len(next(iter(series.values())))
    samples = [{"t": 10.0 * i, **{k: v[i] for k, v in series.items()}} for i in range(n)]
    return soak.verdicts(samples, Load(), argparse.Namespace(growth_tolerance=0.10, agents=2))


def test_levelling_off_is_flat_and_climbing_is_growing() -> None:
    warm_then_flat = [100, 300, 500, 520, 515, 522, 518, 521, 519]
    leak = [100, 150, 200, 250, 300, 350, 400, 450, 500]
    result = run({"proxy rss_mib": warm_then_flat, "kvindex rss_mib": leak,
                  "proxy fds": [20, 21, 23, 22, 24, 22, 25, 23, 24],
                  "proxy sessions table": [0, 3, 2, 3, 1, 3, 2, 3, 2]})
    assert result["growing"] == ["kvindex rss_mib"]
    assert not result["target"]["met"]
    assert result["series"]["proxy rss_mib"]["flat"]
    assert result["turns_per_s"] == 300 / 80


def test_a_slow_climb_hidden_in_noise_is_growing() -> None:
    """Thirds' maxima within 10 %, but rising steadily through the second half."""
    noisy_climb = [1000, 1200, 1150, 1250, 1180, 1230, 1260, 1300, 1330]
    result = run({"decode-0 rss_mib": noisy_climb,
                  "redis used MiB table": [1.4, 3, 5, 7, 8.0, 8.1, 8.0, 8.1, 8.0]})
    assert result["growing"] == ["decode-0 rss_mib"]
    assert result["series"]["decode-0 rss_mib"]["second_half_rise_per_run"] > 100


def test_a_process_is_sampled_with_its_children() -> None:
    rss, fds = soak.process_sample(os.getpid())
    assert rss > 10 and fds >= 3
    assert soak.process_sample(2**22 + 12345) == (0.0, 0)  # gone: nothing, no error


def level(agents: int, turns_per_s: float, p95_ms: float) -> dict:
    return {"agents": agents, "turns": 100, "turns_per_s": turns_per_s, "p95_ms": p95_ms}


def test_the_knee_is_the_last_level_before_more_agents_only_queue() -> None:
    args = argparse.Namespace(min_gain=0.10, max_p95_rise=0.25)
    rows = [level(1, 5.0, 300), level(2, 9.0, 330), level(4, 12.0, 420), level(8, 12.5, 900),
            level(16, 12.6, 1900)]
    found = concurrency.knee(rows, args)
    assert found["agents"] == 4 and found["reached"] and "8 agents" in found["why"]
    # still scaling at the top: the knee is not reached, the highest level is reported
    growing = concurrency.knee(rows[:3], args)
    assert growing == {"agents": 4, "reached": False,
                       "why": "throughput still grew at the highest level run"}
