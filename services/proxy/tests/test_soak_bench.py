"""The soak bench's judgement (``bench.soak_bench``), on hand-made samples: a series that
levels off is flat, one still climbing in the last third is growing, and noise on small
numbers is not growth; and what it samples of a process is real."""

from __future__ import annotations

import argparse
import os

from agentserving.core.testing import import_bench

soak = import_bench("soak_bench")


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


def test_a_process_is_sampled_with_its_children() -> None:
    rss, fds = soak.process_sample(os.getpid())
    assert rss > 10 and fds >= 3
    assert soak.process_sample(2**22 + 12345) == (0.0, 0)  # gone: nothing, no error
