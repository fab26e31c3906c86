"""Test helpers shared by the replay tests and the e2e tests (the fake completions server is
in ``agentserving.replay.fake_server``)."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

AGENTSERVING = str(Path(sys.executable).parent / "agentserving")


@functools.cache
def has_subcommand(name: str) -> bool:
    """`agentserving NAME --help` works."""
    try:
        return subprocess.run([AGENTSERVING, name, "--help"], capture_output=True,
                              timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def pid_alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")
