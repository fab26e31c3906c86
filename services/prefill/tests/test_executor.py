"""The engine's prefill-pass rule, which the engine, the policies, the simulator and the bench
all take from ``policies.executor``."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from agentserving.prefill.policies.executor import pass_end, pass_limit


@given(total=st.integers(1, 5000), cached_chunks=st.integers(0, 20),
       budgets=st.lists(st.integers(1, 3000), min_size=1, max_size=64),
       chunk=st.sampled_from([1, 16, 256]))
def test_passes_end_on_chunk_boundaries_and_the_partial_tail_runs_alone(
        total, cached_chunks, budgets, chunk):
    start = min(cached_chunks * chunk, total - 1)
    full_end = total - total % chunk
    ends = []
    while start < total:
        end = pass_end(start, total, budgets[len(ends) % len(budgets)], chunk)
        assert start < end <= total
        if end < total:
            assert end % chunk == 0  # a non-final pass ends on the chunk grid
        if start < full_end:
            assert end <= full_end  # the partial tail is never in the same pass as a full chunk
        ends.append(end)
        start = end
    assert ends[-1] == total


def test_the_limit_without_the_tail_split_is_the_prompt():
    assert pass_limit(0, 600, 256) == 512
    assert pass_limit(512, 600, 256) == 600
    assert pass_limit(0, 600, 256, split_tail=False) == 600
    assert pass_limit(0, 600, 1) == 600
