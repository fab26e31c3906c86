"""The engine process's malloc settings (engine/allocator.py): what it sets, and that what an
operator set in the environment wins."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from agentserving.engine.allocator import SETTINGS, SWITCH_ENV, settings_to_apply, tuning_wanted


def test_every_setting_applies_unless_the_environment_makes_it():
    assert settings_to_apply({}) == SETTINGS
    left = settings_to_apply({"MALLOC_ARENA_MAX": "8", "PATH": "/bin"})
    assert "MALLOC_ARENA_MAX" not in left and set(left) == set(SETTINGS) - {"MALLOC_ARENA_MAX"}


def _applied(env: dict[str, str]) -> dict[str, str]:
    code = ("import json; from agentserving.engine.allocator import bound_malloc_growth; "
            "print(json.dumps(bound_malloc_growth()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=env)
    return json.loads(out.stdout)


def test_glibc_takes_the_settings_in_a_fresh_process():
    done = _applied({"MALLOC_ARENA_MAX": "4"})
    assert done["malloc"] == "glibc"  # Debian: glibc
    assert done["MALLOC_MMAP_THRESHOLD_"] == "131072"
    assert done["MALLOC_TRIM_THRESHOLD_"] == "262144"
    assert "MALLOC_ARENA_MAX" not in done  # the operator's value stands


def test_the_tuning_can_be_switched_off():
    """The trade is memory for speed (docs/benchmarks.md, "Soak and concurrency"): an
    operator who wants glibc's own behaviour back says so, and nothing is set."""
    done = _applied({SWITCH_ENV: "off"})
    assert set(done) == {"malloc"} and "left as it is" in done["malloc"]


@pytest.mark.parametrize(("value", "wanted"), [("on", True), ("1", True), ("true", True),
                                               ("off", False), ("OFF", False), ("no", False),
                                               ("0", False)])
def test_the_switch_reads_booleans_as_the_connector_settings_do(value, wanted):
    assert tuning_wanted({SWITCH_ENV: value}) is wanted
    assert tuning_wanted({}) is True


def test_a_mistyped_switch_is_an_error_naming_the_variable():
    with pytest.raises(ValueError, match=SWITCH_ENV):
        tuning_wanted({SWITCH_ENV: "of"})
