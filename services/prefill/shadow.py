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
    """seconds ~ a + b * new_tokens + c * context_tokens [+ d * attention_pairs], least
    squares (non-negative) over recent steps.

    ``context_tokens`` is the KV already on the pod that the step's chunks attend to (each
    chunk's start), summed over the step's chunks and decodes. With ``attention=True`` the
    model adds the attention term: ``attention_pairs`` sums, over the step's chunks, the
    (query, key) pairs the chunk computes, ``n * (start + (n + 1) / 2)``. Prefill attention
    is quadratic in the prompt: charged by ``context_tokens`` alone, a prompt prefilled whole
    pays nothing for it (start 0) while the same prompt in chunks pays ``c * start`` per chunk
    whatever the chunk's size, so chunking looks far dearer than it is. The pair count is the
    same however a prompt is split, so only the per-step ``a`` and the per-chunk KV read
    ``c`` make chunking cost more. The 3-term form (the default) is what ``sim`` profiles
    store. Until ``min_samples`` steps are seen it uses the prior."""

    def __init__(self, prior: tuple[float, ...] | None = None, window: int = 512,
                 min_samples: int = 8, attention: bool = False) -> None:
        self.attention = attention
        if prior is None:
            prior = (0.01, 2e-4, 0.0, 0.0) if attention else (0.01, 2e-4, 0.0)
        if len(prior) != (4 if attention else 3):
            raise ValueError("prior needs 4 coefficients with attention=True, else 3")
        self.coef = np.array(prior, dtype=float)
        self.window = window
        self.min_samples = min_samples
        self._rows: list[tuple[float, ...]] = []

    @staticmethod
    def features(decision: Decision, state: SchedState) -> tuple[int, int]:
        computed = {r.req_id: r.computed for r in state.running + state.waiting}
        new = decision.new_tokens + len(decision.decode)
        ctx = sum(computed.get(rid, 0) for rid, n in decision.prefill)
        ctx += sum(computed.get(rid, 0) for rid in decision.decode)
        return new, ctx

    @staticmethod
    def attention_pairs(decision: Decision, state: SchedState) -> float:
        computed = {r.req_id: r.computed for r in state.running + state.waiting}
        pairs = sum(n * (computed.get(rid, 0) + (n + 1) / 2) for rid, n in decision.prefill)
        return float(pairs + sum(computed.get(rid, 0) + 1 for rid in decision.decode))

    @staticmethod
    def chunk_pairs(new_tokens: int, context_tokens: int) -> float:
        """Attention pairs of one chunk of ``new_tokens`` starting at ``context_tokens``."""
        return new_tokens * (context_tokens + (new_tokens + 1) / 2)

    def observe(self, new_tokens: int, context_tokens: int, seconds: float,
                pairs: float | None = None) -> None:
        """One measured step. ``pairs`` defaults to a single chunk's (exact for one chunk;
        use ``observe_step`` for a step of several)."""
        if self.attention:
            if pairs is None:
                pairs = self.chunk_pairs(new_tokens, context_tokens)
            row: tuple[float, ...] = (float(new_tokens), float(context_tokens), float(pairs),
                                      float(seconds))
        else:
            row = (float(new_tokens), float(context_tokens), float(seconds))
        self._rows.append(row)
        if len(self._rows) > self.window:
            del self._rows[: len(self._rows) - self.window]
        if len(self._rows) >= self.min_samples:
            self.fit()

    def observe_step(self, decision: Decision, state: SchedState, seconds: float) -> None:
        new, ctx = self.features(decision, state)
        pairs = self.attention_pairs(decision, state) if self.attention else None
        self.observe(new, ctx, seconds, pairs)

    def fit(self) -> None:
        rows = np.array(self._rows)
        x = np.column_stack([np.ones(len(rows)), rows[:, :-1]])
        self.coef = nonneg_lstsq(x, rows[:, -1])  # a negative cost is never physical

    def predict(self, new_tokens: int, context_tokens: int,
                pairs: float | None = None) -> float:
        t = self.coef[0] + self.coef[1] * new_tokens + self.coef[2] * context_tokens
        if self.attention:
            if pairs is None:
                pairs = self.chunk_pairs(new_tokens, context_tokens)
            t += self.coef[3] * pairs
        return float(t)

    def predict_step(self, decision: Decision, state: SchedState) -> float:
        new, ctx = self.features(decision, state)
        pairs = self.attention_pairs(decision, state) if self.attention else None
        return self.predict(new, ctx, pairs)


def nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (active set: a column whose coefficient
    comes out negative is dropped and the rest refitted)."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            return coef
        active.pop(int(np.argmin(sol)))
    return coef


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
        self.model = model or StepTimeModel(attention=True)
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

    def observe_step(self, decision: Decision, state: SchedState, seconds: float) -> None:
        """A measured step: the decision that ran, the state it ran on, its seconds."""
        self.model.observe_step(decision, state, seconds)
