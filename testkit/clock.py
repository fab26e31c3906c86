"""A clock the test moves: code under test that takes a ``clock`` callable (time.monotonic or
time.time by default) reads ``now`` from it, and the test sets or advances ``now`` itself, so
expiries, leases and half-lives are checked without sleeping."""

from __future__ import annotations


class ManualClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
