"""Open any trace the replay understands: its own session format, or a Mooncake trace.

The format is recognised from the first non-empty line (Mooncake lines carry ``hash_ids``).
``bundled:NAME`` names a workload that ships with the package: a trace file in
``replay/workloads/`` (``agent-mix``, imported from real traces: docs/replay.md says how to
remake it), else a generated one (``agentserving.replay.synthetic.PRESETS``).
"""

from __future__ import annotations

import json
from pathlib import Path

from agentserving.replay.mooncake import MooncakeOptions, is_mooncake_line, read_mooncake
from agentserving.replay.trace import Trace, TraceFormatError, read_trace

WORKLOADS = Path(__file__).resolve().parent / "workloads"


def bundled_names() -> list[str]:
    """Every ``bundled:NAME``: the shipped trace files and the synthetic presets."""
    from agentserving.replay.synthetic import PRESETS

    return sorted({p.name.removesuffix(".jsonl") for p in WORKLOADS.glob("*.jsonl")}
                  | set(PRESETS))


def detect_format(path: str | Path) -> str:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    obj = json.loads(line)
                except ValueError as exc:
                    raise TraceFormatError(f"{path}: first line is not JSON: {exc}") from exc
                return "mooncake" if is_mooncake_line(obj) else "sessions"
    raise TraceFormatError(f"{path}: empty trace")


def load_trace(spec: str | Path, *, limit: int | None = None,
               mooncake: MooncakeOptions | None = None) -> Trace:
    """Load ``spec`` (a file path or ``bundled:NAME``), keeping the first ``limit`` sessions."""
    text = str(spec)
    if text.startswith("bundled:"):
        from agentserving.replay.synthetic import PRESETS, generate_preset

        name = text.split(":", 1)[1]
        shipped = WORKLOADS / f"{name}.jsonl"
        if shipped.is_file():
            trace = read_trace(shipped)
        elif name in PRESETS:
            trace = generate_preset(name)
        else:
            raise ValueError(f"unknown bundled workload {name!r}; known: "
                             f"{', '.join(bundled_names())}")
    elif detect_format(text) == "mooncake":
        trace = read_mooncake(text, mooncake)
    else:
        trace = read_trace(text)
    return trace.limit(limit)
