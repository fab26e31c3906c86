"""Waiting on conditions of real processes, for the test cluster and its node."""

from __future__ import annotations

import time


class Fatal(RuntimeError):
    """Raised by a polled condition that can never hold any more (e.g. its process died)."""


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    """Poll predicate() until it returns something truthy; TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Fatal:
            raise
        except Exception as e:  # noqa: BLE001 - polled conditions may fail until they hold
            last_error = e
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}"
                       + (f" (last error: {last_error})" if last_error else ""))
