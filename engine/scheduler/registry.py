"""The scheduling policies a worker can name, and the one factory that builds them: the
engine's own (``policy``) and the prefill role's pure policies adapted to the engine
(``prefill_policies``). It sits above both, so neither imports the other back."""

from __future__ import annotations

import importlib
import urllib.parse
from collections.abc import Callable

from agentserving.engine.scheduler import prefill_policies
from agentserving.engine.scheduler.policy import FcfsPolicy, SchedulerPolicy

PolicyFactory = Callable[..., SchedulerPolicy]  # (chunk_tokens, **options) -> policy

POLICIES: dict[str, PolicyFactory] = {
    "fcfs": lambda chunk_tokens, decode_steps="1", **_opts: FcfsPolicy(
        chunk_tokens, int(decode_steps)),
}


def make_policy(spec: str, chunk_tokens: int) -> SchedulerPolicy:
    """Build a policy from ``NAME[?opt=value&...]``: a name in ``POLICIES``, one of the prefill
    role's policies, or ``package.module:Class`` (called with ``chunk_tokens`` and the
    options)."""
    name, _, query = spec.partition("?")
    options = dict(urllib.parse.parse_qsl(query, keep_blank_values=True))
    factory = POLICIES.get(name)
    if factory is not None:
        return factory(chunk_tokens, **options)
    if ":" in name:
        module, attr = name.split(":", 1)
        return getattr(importlib.import_module(module), attr)(chunk_tokens, **options)
    if name in prefill_policies.ENGINE_POLICIES:
        return prefill_policies.make_engine_policy(name, chunk_tokens, **options)
    raise ValueError(f"unknown scheduler policy {name!r}; known: {policy_names()}")


def policy_names() -> list[str]:
    """Every name ``make_policy`` builds (besides ``module:Class``): what a worker's
    ``--scheduler-policy`` may name, and the AgentServing CRD's ``schedulerPolicy`` enum."""
    return sorted(POLICIES) + sorted(prefill_policies.ENGINE_POLICIES)
