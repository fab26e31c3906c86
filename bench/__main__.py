"""Runs every benchmark module in this folder (``*_bench.py``), one after another.

    python -m bench                 # all of them, full sizes
    python -m bench --quick         # all of them, smoke sizes
    python -m bench kvindex         # only bench/kvindex_bench.py

Everything from the first flag on is passed to each module's ``main``; each writes its own
JSON under ``bench/results/``. Exits non-zero if any benchmark failed.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import time
import traceback
from pathlib import Path

SUFFIX = "_bench"


def discover() -> list[str]:
    """The benchmark names (``kvindex`` for ``kvindex_bench.py``), sorted."""
    folder = Path(__file__).resolve().parent
    return sorted(m.name[: -len(SUFFIX)] for m in pkgutil.iter_modules([str(folder)])
                  if m.name.endswith(SUFFIX))


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(__doc__.strip())
        print("\nbenchmarks:", ", ".join(discover()) or "(none)")
        return 0
    available = discover()
    split = next((i for i, a in enumerate(args) if a.startswith("-")), len(args))
    names, flags = args[:split], args[split:]
    unknown = sorted(set(names) - set(available))
    if unknown:
        print(f"unknown benchmark(s) {unknown}; available: {available}", file=sys.stderr)
        return 2
    failed = []
    for name in names or available:
        print(f"== bench {name} ==", flush=True)
        start = time.perf_counter()
        try:
            module = importlib.import_module(f"bench.{name}{SUFFIX}")
            rc = module.main(flags) or 0
        except SystemExit as exc:  # argparse errors and explicit exits
            rc = exc.code if isinstance(exc.code, int) else 1
        except Exception:  # noqa: BLE001 - one broken bench must not hide the others
            traceback.print_exc()
            rc = 1
        print(f"== bench {name}: {'ok' if rc == 0 else f'FAILED ({rc})'} "
              f"in {time.perf_counter() - start:.1f}s ==", flush=True)
        if rc:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
