"""The kvindex and proxy images are built without torch: their code must never import it."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["agentserving.kvindex.app", "agentserving.kvindex.cli",
                                    "agentserving.proxy.app", "agentserving.proxy.cli",
                                    "agentserving.core.cli"])
def test_light_services_do_not_import_torch(module):
    code = (f"import sys, importlib; importlib.import_module({module!r}); "
            "heavy = sorted(m for m in ('torch', 'transformers', 'lmcache') if m in sys.modules); "
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"{module} imports {out.stdout.strip()}"
