"""ShadowScheduler: the policy run ahead of time, and the N+1 prefetch trigger.

Each step, after the wrapped policy decides the current step N, the shadow runs the same
policy forward over steps N+1..N+``lookahead`` from the state that decision leaves (no new
arrivals assumed) and records, for every waiting request, the step offset and the estimated
time (``StepTimeModel``) at which it would be admitted. When a waiting request is first
predicted for admission within ``prefetch_window`` steps (default 1: the N+1 window), the
shadow asks for its disk-resident chunks to be moved to DRAM — once per request, and never
earlier. Pure: it returns what to prefetch; the caller starts the I/O. Predictions only steer
prefetch: the decision for step N is the wrapped policy's, and a late or failed prefetch just
means the engine loads from disk or recomputes.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from agentserving.prefill.policies.base import PurePolicy
from agentserving.prefill.policies.types import Decision, SchedState, advance


class StepTimeModel:
    """seconds ~ a + b * new_tokens + c * context_tokens, least squares over recent steps.

    ``context_tokens`` is the KV already on the pod that the step's chunks attend to (each
    chunk's start), summed over the step's chunks and decodes. Until ``min_samples`` steps
    are seen it uses the prior."""

    def __init__(self, prior: tuple[float, float, float] = (0.01, 2e-4, 0.0),
                 window: int = 512, min_samples: int = 8) -> None:
        self.coef = np.array(prior, dtype=float)
        self.window = window
        self.min_samples = min_samples
        self._rows: list[tuple[float, float, float]] = []

    @staticmethod
    def features(decision: Decision, state: SchedState) -> tuple[int, int]:
        computed = {r.req_id: r.computed for r in state.running + state.waiting}
        new = decision.new_tokens + len(decision.decode)
        ctx = sum(computed.get(rid, 0) for rid, n in decision.prefill)
        ctx += sum(computed.get(rid, 0) for rid in decision.decode)
        return new, ctx

    def observe(self, new_tokens: int, context_tokens: int, seconds: float) -> None:
        self._rows.append((float(new_tokens), float(context_tokens), float(seconds)))
        if len(self._rows) > self.window:
            del self._rows[: len(self._rows) - self.window]
        if len(self._rows) >= self.min_samples:
            self.fit()

    def fit(self) -> None:
        rows = np.array(self._rows)
        x = np.column_stack([np.ones(len(rows)), rows[:, 0], rows[:, 1]])
        coef, *_ = np.linalg.lstsq(x, rows[:, 2], rcond=None)
        self.coef = np.maximum(coef, 0.0)  # a negative cost is never physical

    def predict(self, new_tokens: int, context_tokens: int) -> float:
        a, b, c = self.coef
        return float(a + b * new_tokens + c * context_tokens)

    def predict_step(self, decision: Decision, state: SchedState) -> float:
        return self.predict(*self.features(decision, state))


@dataclasses.dataclass(frozen=True)
class Prediction:
    offset: int        # predicted admission at step N + offset
    eta_s: float       # predicted seconds from now until that step starts


@dataclasses.dataclass
class ShadowResult:
    decision: Decision
    predictions: dict[str, Prediction]
    prefetch: list[tuple[str, tuple[str, ...]]]  # (req_id, disk chunk hashes) to start now


class ShadowScheduler:
    def __init__(self, policy: PurePolicy, lookahead: int = 5, prefetch_window: int = 1,
                 model: StepTimeModel | None = None) -> None:
        if lookahead < 1 or not 1 <= prefetch_window <= lookahead:
            raise ValueError("need 1 <= prefetch_window <= lookahead")
        self.policy = policy
        self.name = f"shadow({policy.name})"
        self.chunk_align = policy.chunk_align
        self.lookahead = lookahead
        self.prefetch_window = prefetch_window
        self.model = model or StepTimeModel()
        self.prefetched: set[str] = set()
        self.last: dict[str, Prediction] = {}

    def decide(self, state: SchedState) -> Decision:
        return self.step(state).decision

    def step(self, state: SchedState) -> ShadowResult:
        decision = self.policy.decide(state)
        predictions = self.look_ahead(state, decision)
        waiting = {w.req_id: w for w in state.waiting}
        prefetch = []
        for rid, pred in predictions.items():
            if pred.offset <= self.prefetch_window and rid not in self.prefetched:
                w = waiting[rid]
                self.prefetched.add(rid)
                if w.disk_chunks:
                    prefetch.append((rid, w.disk_chunks))
        # requests admitted now no longer need their bookkeeping
        self.prefetched.difference_update(decision.admit)
        self.last = predictions
        return ShadowResult(decision, predictions, prefetch)

    def look_ahead(self, state: SchedState, decision: Decision) -> dict[str, Prediction]:
        out: dict[str, Prediction] = {}
        eta = self.model.predict_step(decision, state)
        s = advance(state, decision)
        for k in range(1, self.lookahead + 1):
            if not s.waiting:
                break
            d = self.policy.decide(s)
            for rid in d.admit:
                out[rid] = Prediction(k, eta)
            eta += self.model.predict_step(d, s)
            s = advance(s, d)
        return out

    def observe(self, new_tokens: int, context_tokens: int, seconds: float) -> None:
        self.model.observe(new_tokens, context_tokens, seconds)
