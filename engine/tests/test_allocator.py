"""The engine process's malloc settings (engine/allocator.py): what it sets, and that what an
operator set in the environment wins."""

from __future__ import annotations

import json
import subprocess
import sys

from agentserving.engine.allocator import SETTINGS, settings_to_apply


def test_every_setting_applies_unless_the_environment_makes_it():
    assert settings_to_apply({}) == SETTINGS
    left = settings_to_apply({"MALLOC_ARENA_MAX": "8", "PATH": "/bin"})
    assert "MALLOC_ARENA_MAX" not in left and set(left) == set(SETTINGS) - {"MALLOC_ARENA_MAX"}


def test_glibc_takes_the_settings_in_a_fresh_process():
    code = ("import json; from agentserving.engine.allocator import bound_malloc_growth; "
            "print(json.dumps(bound_malloc_growth()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"MALLOC_ARENA_MAX": "4"})
    done = json.loads(out.stdout)
    assert done["malloc"] == "glibc"  # Debian: glibc
    assert done["MALLOC_MMAP_THRESHOLD_"] == "131072"
    assert done["MALLOC_TRIM_THRESHOLD_"] == "262144"
    assert "MALLOC_ARENA_MAX" not in done  # the operator's value stands
