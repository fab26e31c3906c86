"""What every benchmark shares: writing its JSON result and taking percentiles."""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def write_result(path: Path, result: dict[str, Any]) -> None:
    """Write one benchmark's JSON result (creating its folder) and say where it went."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


def percentile(samples: list[float], q: float) -> float:
    """Nearest-rank percentile, q in [0, 1]."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def add_run_args(parser: argparse.ArgumentParser, quick: str, out: Path,
                 plot: bool = False) -> None:
    """The flags every fleet bench ends with: --quick (``quick`` says what it shrinks to),
    --no-progress, --out (with ``plot``, the PNG goes beside it)."""
    parser.add_argument("--quick", action="store_true", help=f"Smoke sizes (CI): {quick}.")
    parser.add_argument("--no-progress", action="store_true", help="No progress bar.")
    parser.add_argument("--out", type=Path, default=out, help="Where the JSON results go" + (
        " (the plot beside it, .png)." if plot else "."))


def session_parser(prog: str, description: str, default_out: Path) -> argparse.ArgumentParser:
    """The long-session benches' flags: --out, --quick, --context, --reps (a bench adds its
    own, then calls ``finish_session_args`` on what it parsed)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--out", type=Path, default=default_out,
                        help=f"where to write the JSON results (default {default_out})")
    parser.add_argument("--quick", action="store_true",
                        help="smoke sizes: a 4 k-token context, one repetition")
    parser.add_argument("--context", type=int, default=None,
                        help="turn-1 prompt tokens (default 16384; 4096 with --quick)")
    parser.add_argument("--reps", type=int, default=None,
                        help="sessions per condition (default 3; 1 with --quick)")
    return parser


def finish_session_args(args: argparse.Namespace) -> argparse.Namespace:
    args.context = args.context or (4096 if args.quick else 16384)
    args.reps = args.reps or (1 if args.quick else 3)
    return args


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
