"""What every benchmark shares: writing its JSON result and taking percentiles."""

from __future__ import annotations

import json
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
