"""Run a command, and everything it spawns, on a fraction of one core: a machine that slow.

``python -m testkit.cpu_quota --cores 0.5 -- CMD...`` puts itself in a CPU cgroup of its own
(``agentserving-tests/NAME`` under the cpu controller, cgroup v1 or v2; NAME defaults to its
pid) capped at ``--cores`` of one core, then execs CMD: a vLLM pod started this way computes at
that share of its speed, whatever else the machine does. The vLLM tests start their pods so
when ``AGENTSERVING_TEST_VLLM_CPU_QUOTA`` is set (``wrap``), to show they pass on a machine that
much slower; ``remove_empty()`` deletes the cgroups whose processes are gone. Needs root
(writes under /sys/fs/cgroup).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 100_000
PARENT = "agentserving-tests"
ENV = "AGENTSERVING_TEST_VLLM_CPU_QUOTA"


def quota() -> float:
    """The share of a core each vLLM pod of the tests gets (0: unthrottled)."""
    return float(os.environ.get(ENV) or 0)


def wrap(argv: list[str], cores: float) -> list[str]:
    """``argv`` run on ``cores`` of one core, in a cgroup of its own."""
    return [sys.executable, "-m", "testkit.cpu_quota", "--cores", f"{cores:g}", "--", *argv]


def _v1() -> bool:
    return (ROOT / "cpu" / "cpu.cfs_quota_us").exists()


def _folder(name: str) -> Path:
    return (ROOT / "cpu" if _v1() else ROOT) / PARENT / name


def join(name: str, cores: float) -> Path:
    """Create the cgroup ``name`` capped at ``cores`` and move this process into it."""
    folder, v1 = _folder(name), _v1()
    if not v1:  # cgroup v2: the parent must hand the cpu controller down
        (ROOT / "cgroup.subtree_control").write_text("+cpu")
    folder.mkdir(parents=True, exist_ok=True)
    if not v1:
        (folder.parent / "cgroup.subtree_control").write_text("+cpu")
    quota = max(1000, int(cores * PERIOD_US))
    if v1:
        (folder / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (folder / "cpu.cfs_quota_us").write_text(str(quota))
    else:
        (folder / "cpu.max").write_text(f"{quota} {PERIOD_US}")
    (folder / "cgroup.procs").write_text(str(os.getpid()))
    return folder


def remove_empty() -> None:
    """Delete every cgroup of ours whose processes are gone (and the parent, once empty)."""
    parent = _folder("x").parent
    for path in [*(parent.iterdir() if parent.is_dir() else ()), parent]:
        if path.is_dir():
            with contextlib.suppress(OSError):  # busy: a process still in it
                path.rmdir()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cores", type=float, required=True,
                        help="the share of one core the command may use, e.g. 0.5")
    parser.add_argument("--name", default=None,
                        help="the cgroup's name, one per command [default: this pid]")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command after --")
    join(args.name or f"pid-{os.getpid()}", args.cores)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
