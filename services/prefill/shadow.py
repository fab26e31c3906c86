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

import collections
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from agentserving.prefill.policies.base import PurePolicy
from agentserving.prefill.policies.types import Decision, ReqView, SchedState, advance

PHANTOM = "\x00phantom-"  # ids of the look-ahead's expected arrivals (never a real id)
# ids of announced turns (``ExpectedTurns``): a session's next turn, due after its tool call
EXPECTED = "\x00expected-"


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
        self._coef = np.array(prior, dtype=float)
        self._dirty = False  # rows changed since the last fit
        self.window = window
        self.min_samples = min_samples
        self._rows: list[tuple[float, ...]] = []

    @property
    def coef(self) -> np.ndarray:
        """The coefficients, refitted first if steps were observed since the last fit. Lazy:
        the fit runs when a prediction needs it, not on every observed step (a simulator
        observes every step of every pod but predicts only while requests wait); the
        coefficients a prediction sees are the same either way."""
        if self._dirty:
            self._dirty = False
            self.fit()
        return self._coef

    @coef.setter
    def coef(self, value: np.ndarray) -> None:
        self._coef = np.asarray(value, dtype=float)
        self._dirty = False

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
            self._dirty = True

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
        coef = self.coef
        t = coef[0] + coef[1] * new_tokens + coef[2] * context_tokens
        if self.attention:
            if pairs is None:
                pairs = self.chunk_pairs(new_tokens, context_tokens)
            t += coef[3] * pairs
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
    # the estimated chance that no arrival during step N overtakes it (offset 1 with
    # ``robust`` on; 1.0 otherwise)
    p_admit: float = 1.0


@dataclasses.dataclass
class ShadowResult:
    decision: Decision
    predictions: dict[str, Prediction]
    prefetch: list[tuple[str, tuple[str, ...]]]  # (req_id, disk chunk hashes) to start now
    # the requests predicted for admission within ``prefetch_window`` steps (the N+1 window
    # by default): the prediction the prefetch acts on, and the one the bench scores
    window: frozenset[str] = frozenset()


class ShadowScheduler:
    """See the module docstring. ``arrivals=True`` makes the look-ahead expect arrivals: the
    rate is estimated from the arrival times of the last ``arrival_window`` requests seen
    waiting; during each simulated step of predicted length t it adds ``rate * t`` expected
    arrivals (a phantom request once the running expectation reaches one half) of the
    recent arrivals' median remaining length. Without it a turn the policy would let a
    newcomer overtake (``longcap-dynamic`` with ``short_order=shortest``) is predicted as if
    nobody came: the N+1 window's precision drops. Phantoms are never reported.

    ``robust=θ`` (0: off) puts a request in the N+1 window only if it is likely to survive
    the arrivals of step N: the deterministic look-ahead assumes nobody comes, but under a
    shortest- or cheapest-first order any newcomer the policy would rank ahead takes the
    slot. The shadow keeps snapshots of the recent arrivals (the arrival process's sizes),
    asks the policy, once per sample, which requests it would still admit at N+1 if that
    arrival had come (``robust_samples`` samples, spread over the recent arrivals' sizes),
    and estimates the chance that none of the Poisson arrivals of step N (rate from the
    recent arrivals, duration from the step-time model) overtakes the request:
    ``p = exp(-rate * step_s * share_that_overtakes)``. Only requests with ``p >= θ`` enter
    the window (and are prefetched); the others are prefetched on a later step when their
    admission is likely. The prediction stays a prediction: the decision is the policy's."""

    def __init__(self, policy: PurePolicy, lookahead: int = 5, prefetch_window: int = 1,
                 model: StepTimeModel | None = None, arrivals: bool = False,
                 arrival_window: int = 64, robust: float = 0.0,
                 robust_samples: int = 8, commit: bool = False) -> None:
        if lookahead < 1 or not 1 <= prefetch_window <= lookahead:
            raise ValueError("need 1 <= prefetch_window <= lookahead")
        if not 0.0 <= robust < 1.0 or robust_samples < 1:
            raise ValueError("need 0 <= robust < 1 and robust_samples >= 1")
        self.policy = policy
        self.name = f"shadow({policy.name})"
        self.chunk_align = policy.chunk_align
        self.lookahead = lookahead
        self.prefetch_window = prefetch_window
        self.model = model or StepTimeModel(attention=True)
        self.prefetched: set[str] = set()
        self.last: dict[str, Prediction] = {}
        self.arrivals = arrivals
        self.robust = robust
        self.robust_samples = robust_samples
        self.commit = commit
        self._window: frozenset[str] = frozenset()   # the last step's N+1 window
        self._known: frozenset[str] = frozenset()    # ids waiting at the last step
        self._seen: set[str] = set()
        # (arrival time, remaining tokens, the request as it arrived) of recent arrivals
        self._recent: collections.deque[tuple[float, int, ReqView]] = collections.deque(
            maxlen=max(2, arrival_window))

    def _note_arrivals(self, state: SchedState, decision: Decision) -> None:
        for w in state.waiting:
            if w.req_id not in self._seen:
                self._seen.add(w.req_id)
                self._recent.append((w.arrival, w.remaining, w))
        self._seen.difference_update(decision.admit)

    def arrival_rate(self) -> float:
        """Requests per second over the recent arrivals (0 until 8 were seen)."""
        if len(self._recent) < 8:
            return 0.0
        span = self._recent[-1][0] - self._recent[0][0]
        return (len(self._recent) - 1) / span if span > 0 else 0.0

    def decide(self, state: SchedState) -> Decision:
        return self.step(state).decision

    def step(self, state: SchedState, expected: Sequence[ReqView] = ()) -> ShadowResult:
        """``expected``: turns announced but not arrived (ids under ``EXPECTED``, ``arrival``
        their predicted arrival on ``state.now``'s clock): the look-ahead lets each join the
        queue at its arrival, and one predicted for admission within the window is in the
        result's ``window``, for the caller to read for before it exists (``prefetch`` names
        waiting requests only). The decision for step N never sees them."""
        decision = self.policy.decide(state)
        if self.commit:
            decision = self._keep_commitments(state, decision)
        if self.arrivals or self.robust:
            self._note_arrivals(state, decision)
        predictions = self.look_ahead(state, decision, expected)
        if self.robust:
            predictions = self._with_survival(state, decision, predictions)
        window = frozenset(rid for rid, pred in predictions.items()
                           if pred.offset <= self.prefetch_window
                           and pred.p_admit >= self.robust)
        waiting = {w.req_id: w for w in state.waiting}
        prefetch = []
        for rid in predictions:  # (in prediction order: the caller's I/O order)
            # an announced turn in the window is the caller's to read (it keeps their book)
            if rid in window and rid in waiting and rid not in self.prefetched:
                w = waiting[rid]
                self.prefetched.add(rid)
                if w.disk_chunks:
                    prefetch.append((rid, w.disk_chunks))
        # requests admitted now no longer need their bookkeeping
        self.prefetched.difference_update(decision.admit)
        self.last = predictions
        if self.commit:
            self._window = window
            self._known = frozenset(waiting)
        return ShadowResult(decision, predictions, prefetch, window)

    def _keep_commitments(self, state: SchedState, decision: Decision) -> Decision:
        """With ``commit``: the requests of the last step's N+1 window (their prefetch is
        under way) are admitted now, as predicted. A newcomer that arrived during the last
        step and would take one's place waits one step: the decision is the policy's on the
        queue without the newcomers (the state the look-ahead saw, so it admits the window;
        if it does not, the policy's own decision stands)."""
        waiting = {w.req_id for w in state.waiting}
        owed = (self._window & waiting) - set(decision.admit)
        if not owed:
            return decision
        held = dataclasses.replace(state, waiting=tuple(
            w for w in state.waiting if w.req_id in self._known))
        kept = self.policy.decide(held)
        return kept if owed <= set(kept.admit) else decision

    def arrival_samples(self) -> list[ReqView]:
        """Up to ``robust_samples`` recent arrivals, evenly spread over their sizes."""
        views = sorted((v for _, _, v in self._recent), key=lambda v: (v.remaining, v.computed))
        k = min(self.robust_samples, len(views))
        return [views[(2 * i + 1) * len(views) // (2 * k)] for i in range(k)]

    def _with_survival(self, state: SchedState, decision: Decision,
                       predictions: dict[str, Prediction]) -> dict[str, Prediction]:
        """``predictions`` with ``p_admit`` set on the N+1 ones (see the class docstring)."""
        first = [rid for rid, p in predictions.items() if p.offset == 1]
        rate = self.arrival_rate()
        if not first or rate <= 0:
            return predictions
        s1 = advance(state, decision)
        samples = self.arrival_samples()
        overtaken = dict.fromkeys(first, 0)
        for i, v in enumerate(samples):
            phantom = dataclasses.replace(v, req_id=f"{PHANTOM}s{i}", arrival=float("inf"),
                                          running=False)
            admitted = set(self.policy.decide(
                dataclasses.replace(s1, waiting=s1.waiting + (phantom,))).admit)
            for rid in first:
                overtaken[rid] += rid not in admitted
        step_s = max(0.0, self.model.predict_step(decision, state))
        out = dict(predictions)
        for rid in first:
            share = overtaken[rid] / len(samples)
            out[rid] = dataclasses.replace(predictions[rid],
                                           p_admit=float(np.exp(-rate * step_s * share)))
        return out

    def look_ahead(self, state: SchedState, decision: Decision,
                   announced: Sequence[ReqView] = ()) -> dict[str, Prediction]:
        """``announced`` join the simulated queue at the first step that starts after their
        arrival. Once the simulated queue runs dry the pod would idle: no step is predicted
        past that, so an announced turn due later is in no window (it would be admitted on
        arrival; the caller prefetches such a turn one step ahead of it)."""
        out: dict[str, Prediction] = {}
        s = advance(state, decision)
        pending = sorted(announced, key=lambda v: v.arrival)
        if not s.waiting and not pending:
            return out  # nothing left waiting: nothing to predict (or to fit the model for)
        eta = self.model.predict_step(decision, state)
        rate = self.arrival_rate() if self.arrivals else 0.0
        size = int(np.median([n for _, n, _ in self._recent])) if rate else 0
        expected, step_s, phantoms = 0.0, eta, 0
        for k in range(1, self.lookahead + 1):
            due = [v for v in pending if v.arrival <= state.now + eta]
            if due:
                pending = pending[len(due):]
                s = dataclasses.replace(s, waiting=s.waiting + tuple(due))
            if not s.waiting:
                break
            if rate and size > 0:
                expected += rate * step_s
                while expected >= 0.5:
                    expected -= 1.0
                    phantoms += 1
                    s = dataclasses.replace(s, waiting=s.waiting + (ReqView(
                        f"{PHANTOM}{phantoms}", float("inf"), size),))
            d = self.policy.decide(s)
            for rid in d.admit:
                if not rid.startswith(PHANTOM):
                    out[rid] = Prediction(k, eta)
            step_s = self.model.predict_step(d, s)
            eta += step_s
            s = advance(s, d)
        return out

    def observe(self, new_tokens: int, context_tokens: int, seconds: float) -> None:
        self.model.observe(new_tokens, context_tokens, seconds)

    def observe_step(self, decision: Decision, state: SchedState, seconds: float) -> None:
        """A measured step: the decision that ran, the state it ran on, its seconds."""
        self.model.observe_step(decision, state, seconds)


# ------------------------------------------------------------------ options and scores

SHADOW_OPTIONS = ("lookahead", "prefetch_window", "robust", "commit")
# Seed 003's ShadowScheduler on its live system: the N+1 window (``WindowScore.rates``) and its
# prefetches (``PrefetchScore.as_dict``)
SEED_003_N1 = {"accuracy": 0.9588, "precision": 0.9124, "recall": 0.9307,
               "consumption_precision": 0.9919, "survival": 0.9950}


def policy_named(name: str, opts: dict[str, Any]) -> str:
    """The pure policy a ``--scheduler-policy`` spec names: for ``shadow``, its ``base`` option
    (popped from ``opts``; ``longcap-dynamic`` when absent), else ``name`` itself."""
    return opts.pop("base", "longcap-dynamic") if name == "shadow" else name


def split_shadow_options(opts: dict[str, Any], default_lookahead: int = 0
                         ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(ShadowScheduler keyword arguments, the policy's own options) from one option dict of
    a ``--scheduler-policy NAME?opt=value`` spec, values as strings or numbers. The shadow is
    wanted when ``lookahead`` (after defaulting) is above 0; the first dict is then
    ``ShadowScheduler(policy, **it)``'s, else empty."""
    rest = dict(opts)
    lookahead = int(rest.pop("lookahead", default_lookahead))
    given = [k for k in SHADOW_OPTIONS[1:] if k in rest]
    window = int(rest.pop("prefetch_window", 1))
    robust = float(rest.pop("robust", 0.0))
    commit = str(rest.pop("commit", "0")).lower() in ("1", "true", "yes")
    if lookahead <= 0:
        if given:
            raise ValueError(f"{given[0]}: a ShadowScheduler option, and lookahead is "
                             f"{lookahead} (no ShadowScheduler): set lookahead >= 1")
        return {}, rest
    return {"lookahead": lookahead, "prefetch_window": window, "robust": robust,
            "commit": commit}, rest


@dataclasses.dataclass
class WindowScore:
    """How well the N+1 window predicted the next step's admissions: every request waiting
    at step N is a positive (in the window) or a negative, and it was admitted at step N+1
    or not. ``new_arrivals`` counts the admissions at N+1 of requests that were not waiting
    at N (no prediction could name them: recall counts them only in
    ``recall_incl_new_arrivals``). The same score for the simulator and the live engine."""

    tp: int = 0
    fp: int = 0
    fn: int = 0
    tn: int = 0
    new_arrivals: int = 0

    def add(self, window: frozenset[str] | set[str], waiting: Sequence[str],
            admitted: set[str] | frozenset[str]) -> None:
        for rid in waiting:
            p, a = rid in window, rid in admitted
            if p and a:
                self.tp += 1
            elif p:
                self.fp += 1
            elif a:
                self.fn += 1
            else:
                self.tn += 1
        self.new_arrivals += len(set(admitted) - set(waiting))

    def rates(self) -> dict[str, float | None]:
        """None where nothing was counted (no request ever waited through a step: the
        window had nothing to predict)."""
        tp, fp, fn, tn = self.tp, self.fp, self.fn, self.tn
        return {"accuracy": ratio(tp + tn, tp + fp + fn + tn), "precision": ratio(tp, tp + fp),
                "recall": ratio(tp, tp + fn),
                "recall_incl_new_arrivals": ratio(tp, tp + fn + self.new_arrivals)}

    def as_dict(self) -> dict[str, Any]:
        return {"tp": self.tp, "fp": self.fp, "fn": self.fn, "tn": self.tn,
                "fn_new_arrivals": self.new_arrivals, **self.rates()}


# Why a prediction of the N+1 window failed, as the report states it
MISS_REASONS = {
    # predicted for N+1, not admitted then
    "left_queue": "it left the queue before step N+1 (aborted or cancelled)",
    "engine_refused": "the policy admitted it at N+1 but the engine did not schedule it "
                      "(no free KV blocks, or the engine's own step limits)",
    "overtaken_by_arrival": "a request that arrived during step N was admitted ahead of it",
    "policy_deferred": "the policy gave step N+1 to others (the running requests' chunks or "
                       "the budget came out differently from the look-ahead)",
    # admitted at N+1, not predicted for it
    "predicted_later": "the look-ahead placed it at step N+2 or later (a step predicted "
                       "longer or a budget smaller than it was)",
    "held_back": "predicted for N+1 but kept out of the window: its chance of surviving "
                 "step N's arrivals was under the robust threshold",
    "beyond_look_ahead": "the look-ahead did not reach it",
}


@dataclasses.dataclass
class WindowMisses:
    """The N+1 window's false positives and false negatives (``WindowScore``'s ``fp`` and
    ``fn``) by cause, so a shortfall against the seed's precision and recall says which
    predictions failed and why (``MISS_REASONS``). Pure: the caller gives what it knew at
    step N (window, waiting, predictions) and what happened at N+1."""

    counts: dict[str, int] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(MISS_REASONS, 0))

    def add(self, window: frozenset[str] | set[str], waiting: Sequence[str],
            predictions: Mapping[str, Prediction], *, waiting_next: set[str] | frozenset[str],
            policy_admit: set[str] | frozenset[str], admitted: set[str] | frozenset[str]
            ) -> None:
        before = set(waiting)
        arrival_admitted = bool(set(admitted) - before)
        for rid in window:
            if rid not in before or rid in admitted:
                continue  # an announced turn, or a true positive
            if rid not in waiting_next:
                self.counts["left_queue"] += 1
            elif rid in policy_admit:
                self.counts["engine_refused"] += 1
            elif arrival_admitted:
                self.counts["overtaken_by_arrival"] += 1
            else:
                self.counts["policy_deferred"] += 1
        for rid in set(admitted) & before - set(window):
            pred = predictions.get(rid)
            if pred is None:
                self.counts["beyond_look_ahead"] += 1
            elif pred.offset <= 1:
                self.counts["held_back"] += 1
            else:
                self.counts["predicted_later"] += 1

    def as_dict(self) -> dict[str, int]:
        return dict(self.counts)


@dataclasses.dataclass
class PrefetchScore:
    """What the prefetches were worth at their requests' admission: ``chunks`` asked to
    move disk -> DRAM, ``used`` of them in DRAM when the request was admitted (the disk
    reads saved: consumption), ``landed`` of them the prefetch had loaded by then, ``alive``
    of those still in DRAM (survival: lost only to eviction in between)."""

    chunks: int = 0
    used: int = 0
    landed: int = 0
    alive: int = 0

    def add(self, chunks: int, used: int, landed: int, alive: int) -> None:
        self.chunks += chunks
        self.used += used
        self.landed += landed
        self.alive += alive

    def as_dict(self) -> dict[str, Any]:
        return {"chunks": self.chunks, "used": self.used, "landed": self.landed,
                "alive": self.alive, "consumption_precision": ratio(self.used, self.chunks),
                "survival": ratio(self.alive, self.landed)}


def ratio(part: float, whole: float) -> float | None:
    """part / whole, None when there is no whole (a figure of nothing is not 0 %)."""
    return part / whole if whole else None
