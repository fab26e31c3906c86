"""What every benchmark shares: writing its JSON result and taking percentiles."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def provenance() -> dict[str, Any]:
    """When, how and where a result was produced: a published figure names its run's date,
    command line and machine from its own JSON, not from someone's memory of the run."""
    cpu = next((line.split(":", 1)[1].strip() for line in _cpuinfo()
                if line.startswith("model name")), platform.processor() or "?")
    return {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "argv": sys.argv[1:],
            "machine": {"cpus": os.cpu_count(), "cpu": cpu, "arch": platform.machine(),
                        "python": platform.python_version()}}


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def write_result(path: Path, result: dict[str, Any]) -> None:
    """Write one benchmark's JSON result (creating its folder), with its ``provenance`` under
    ``run``, and say where it went."""
    result = {**result, "run": result.get("run") or provenance()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


def fleet_work_dir(name: str) -> Path:
    """Where a fleet bench's processes log: ``$AGENTSERVING_BENCH_DIR`` (default runs/), one
    folder per run."""
    return Path(os.environ.get("AGENTSERVING_BENCH_DIR", "runs")) / f"{name}-{os.getpid()}"


def save_figure(fig: Any, path: Path) -> None:
    """Write a bench's matplotlib figure as PNG, close it and say where it went."""
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def percentile(samples: list[float], q: float) -> float:
    """Nearest-rank percentile, q in [0, 1]."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def add_out_args(parser: argparse.ArgumentParser, out: Path, quick: str | None = None,
                 plot: bool = False) -> None:
    """The flags every bench has: --quick (``quick`` says what it shrinks to) and --out (with
    ``plot``, the PNG goes beside it)."""
    parser.add_argument("--quick", action="store_true",
                        help="Smoke sizes (CI)" + (f": {quick}." if quick else "."))
    parser.add_argument("--out", type=Path, default=out, help=f"Where the JSON results go "
                        f"(default {out}" + ("; the plot beside it, .png)." if plot else ")."))


def add_run_args(parser: argparse.ArgumentParser, quick: str, out: Path,
                 plot: bool = False) -> None:
    """The flags every fleet bench ends with: ``add_out_args``'s and --no-progress."""
    add_out_args(parser, out, quick, plot)
    parser.add_argument("--no-progress", action="store_true", help="No progress bar.")


def session_parser(prog: str, description: str, default_out: Path) -> argparse.ArgumentParser:
    """The long-session benches' flags: --out, --quick, --context, --reps (a bench adds its
    own, then calls ``finish_session_args`` on what it parsed)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_out_args(parser, default_out, "a 4 k-token context, one repetition")
    parser.add_argument("--context", type=int, default=None,
                        help="turn-1 prompt tokens (default 16384; 4096 with --quick)")
    parser.add_argument("--reps", type=int, default=None,
                        help="sessions per condition (default 3; 1 with --quick)")
    return parser


def finish_session_args(args: argparse.Namespace) -> argparse.Namespace:
    args.context = args.context or (4096 if args.quick else 16384)
    args.reps = args.reps or (1 if args.quick else 3)
    return args


def finish_session_bench(name: str, args: argparse.Namespace, ttft: dict[str, Any],
                         pd: dict[str, Any], started: float,
                         environment: dict[str, Any] | None = None, **fields: Any) -> int:
    """Write a long-session bench's result (the second turn's TTFT by where its prefix came
    from, the P/D hand-off, and how they were measured: ``fields``, the engine and the model)
    to ``args.out``; the exit status is 1 when the P/D decode differed from one pod's (the
    check these benches make)."""
    write_result(args.out, {
        "bench": name, "quick": args.quick, **fields, "context_tokens": args.context,
        "reps": args.reps, "second_turn": ttft, "pd_transfer": pd,
        "environment": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        **(environment or {})},
        "seconds": round(time.time() - started, 1)})
    return 0 if pd["decode_equals_single_pod"] else 1


def wait_on_disk(memory_url: str, hashes: list[str], timeout_s: float = 120.0) -> None:
    """Wait until a pod's memory API lists every chunk in its disk tier (writes are async)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        chunks = httpx.get(memory_url + "/memory/chunks", timeout=30).json()["chunks"]
        if set(hashes) <= set(chunks.get("disk", [])):
            return
        time.sleep(0.1)
    raise TimeoutError("turn-1 chunks never reached the disk tier")


@contextlib.contextmanager
def progress(enabled: bool) -> Iterator[Any]:
    """A rich progress bar when rich is installed and wanted; else a silent stand-in."""
    if enabled:
        try:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )
        except ImportError:
            enabled = False
    if not enabled:
        class Silent:
            def add_task(self, *_a: Any, **_k: Any) -> int:
                return 0

            def advance(self, *_a: Any, **_k: Any) -> None:
                return None

            def update(self, *_a: Any, **_k: Any) -> None:
                return None

        yield Silent()
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), transient=False) as bar:
        yield bar


def vllm_env_ready(bench: str) -> bool:
    """Whether the vLLM CPU environment a vLLM bench starts its pods from is installed; if not,
    says so (naming the bench and the script that installs it)."""
    from agentserving.engine.vllm.serve_command import DEFAULT_ENV_DIR

    if (DEFAULT_ENV_DIR / "bin" / "python").exists():
        return True
    print(f"{bench}: no vLLM env at {DEFAULT_ENV_DIR} (scripts/vllm-env.sh)", file=sys.stderr)
    return False

