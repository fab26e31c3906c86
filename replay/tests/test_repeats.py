"""Medians of repeated runs (agentserving.replay.repeats): pure."""

from __future__ import annotations

from agentserving.replay.repeats import combine, median_of, median_repeat, ratio_spread


def test_numbers_take_their_median_and_the_rest_the_first_runs_value():
    runs = [{"req_per_s": 1.0, "turns_completed": 10, "engine": "vllm", "by_source": {"a": {
                "e2e_p95_s": 3.0}}, "ttft_p50_short_s": None, "events": [1]},
            {"req_per_s": 3.0, "turns_completed": 12, "engine": "vllm", "by_source": {"a": {
                "e2e_p95_s": 1.0}}, "ttft_p50_short_s": 0.5, "events": [2]},
            {"req_per_s": 2.0, "turns_completed": 11, "engine": "vllm", "by_source": {"a": {
                "e2e_p95_s": 2.0}}, "ttft_p50_short_s": 0.7, "events": [3]}]
    m = median_of(runs)
    assert m["req_per_s"] == 2.0 and m["turns_completed"] == 11
    assert isinstance(m["turns_completed"], int)
    assert m["by_source"]["a"]["e2e_p95_s"] == 2.0
    assert m["ttft_p50_short_s"] == 0.6  # runs without the figure left out
    assert m["engine"] == "vllm" and m["events"] == [1]
    assert median_of([{"n": 1}, {"n": 2}])["n"] == 1.5  # an even count: the mean of the two
    assert median_repeat(runs) == 3  # the run with the median req/s


def test_combine_keeps_each_configurations_spread():
    reps = [{"a": {"req_per_s": 4.0, "turns_failed": 0}, "b": {"req_per_s": 1.0}},
            {"a": {"req_per_s": 2.0, "turns_failed": 3}, "b": {"req_per_s": 1.5}},
            {"a": {"req_per_s": 3.0, "turns_failed": 0}, "b": {"req_per_s": 0.5}}]
    out = combine(reps)
    assert out["a"]["req_per_s"] == 3.0 and out["a"]["turns_failed"] == 0
    spread = out["a"]["repeats"]
    assert spread["n"] == 3 and spread["median_repeat"] == 3
    assert spread["min"]["req_per_s"] == 2.0 and spread["max"]["req_per_s"] == 4.0
    assert spread["max"]["turns_failed"] == 3  # a failure in one repeat is not hidden
    assert spread["min"]["e2e_p95_s"] is None
    assert out["b"]["repeats"]["median_repeat"] == 1


def test_the_worst_repeat_is_the_one_least_in_the_candidates_favour():
    def rep(req: float, p95: float) -> dict:
        return {"comparisons": {"vllm-rr": {"ratios": {"req_per_s": req, "e2e_p95_s": p95}}}}
    out = ratio_spread([rep(1.2, 0.8), rep(0.9, 1.1), rep(1.5, 0.7)])["vllm-rr"]
    assert out["req_per_s"]["worst"] == 0.9 and out["req_per_s"]["values"] == [1.2, 0.9, 1.5]
    assert out["e2e_p95_s"]["worst"] == 1.1  # lower is better: the highest ratio is worst
    assert out["e2e_p95_s"]["min"] == 0.7 and "ttft_p50_s" not in out
