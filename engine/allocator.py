"""The engine process's malloc settings, so its resident memory tracks what it holds.

A soak (``python -m bench soak``) showed a decode worker's engine process climbing about
300 MiB an hour while the Python heap it traced stayed flat (~70 MiB, most of it hand-off
frames in flight). The growth was native: the process allocates and frees megabyte buffers all
the time (hand-off frames, per-layer KV, activations) from a dozen threads, and glibc's malloc
(1) raises its mmap threshold each time such a buffer is freed, so later ones come from the
heap instead of mmap and are never handed back, fragmenting it; (2) gives each thread an arena
of its own, up to eight per core. Pinning the mmap threshold (which also stops its adjustment)
makes every large buffer an mmap of its own that ``free`` returns to the kernel, and two arenas
bound the rest. Set with ``mallopt`` at the start of the process, before its threads, so the
image, the local fleet and a bare ``agentserving worker`` all get it without environment
variables (``MALLOC_*`` set by an operator still win: glibc reads them first, and this module
leaves them alone).

It is a trade of speed for memory: side by side on the soak's fleet (150 s each, one run),
the decode worker held 810 MiB with it and 894 MiB without, and served 18 % fewer turns (every
large buffer is a fresh mmap, page faults included). ``AGENTSERVING_MALLOC_TUNING=off`` leaves
glibc as it is.

Only glibc is handled; elsewhere (musl, macOS) this is a no-op that says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Mapping

from pydantic import TypeAdapter, ValidationError

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's own starting value, now fixed
TRIM_THRESHOLD_BYTES = 256 * 1024  # twice it, as glibc's dynamic rule would set
ARENA_MAX = 2
# glibc's environment variable -> (mallopt parameter, value)
SETTINGS = {"MALLOC_MMAP_THRESHOLD_": (M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
            "MALLOC_TRIM_THRESHOLD_": (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
            "MALLOC_ARENA_MAX": (M_ARENA_MAX, ARENA_MAX)}


def settings_to_apply(environ: Mapping[str, str]) -> dict[str, tuple[int, int]]:
    """The settings the environment does not already make, by their variable's name."""
    return {name: setting for name, setting in SETTINGS.items() if name not in environ}


SWITCH_ENV = "AGENTSERVING_MALLOC_TUNING"  # "off": leave glibc's malloc as it is


def tuning_wanted(environ: Mapping[str, str]) -> bool:
    """The switch read as pydantic reads a boolean (on/off, true/false, yes/no, 1/0), as the
    connector's settings are; anything else is an error that names the variable, not a
    silent default."""
    value = environ.get(SWITCH_ENV, "on")
    try:
        return TypeAdapter(bool).validate_python(value)
    except ValidationError:
        raise ValueError(f"{SWITCH_ENV}={value!r}: expected on or off") from None


def bound_malloc_growth() -> dict[str, str]:
    """Applies :func:`settings_to_apply`; returns what was done, for the start-up log."""
    if not tuning_wanted(os.environ):
        return {"malloc": f"left as it is ({SWITCH_ENV}=off)"}
    path = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(path or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return {"malloc": "not glibc: left as it is"}
    done = {"malloc": "glibc"}
    for name, (param, value) in settings_to_apply(os.environ).items():
        ok = mallopt(ctypes.c_int(param), ctypes.c_int(value)) == 1
        done[name] = str(value) if ok else "refused"
    return done
