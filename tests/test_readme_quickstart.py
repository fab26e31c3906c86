"""The README's quick start, run as a newcomer would run it.

The commands are read from the README's first ```bash block after `<!-- quickstart -->`, so a
README edit that breaks the quick start breaks this test. Two things differ from a newcomer's
terminal, both substitutions of literal text: the proxy port (8080 may be taken on a shared
machine: a free port instead) and the run folder (a temporary one). Everything else runs as
written: the reference engine's fleet (kvindex, one prefill and one decode worker, the proxy)
on loopback, two turns of one session through the proxy with curl, then Ctrl-C's equivalent.
"""

from __future__ import annotations

import ast
import json
import os
import re
import socket
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MARKER = "<!-- quickstart -->"


def quickstart_block(readme: str) -> str:
    """The first ```bash block after the marker."""
    after = readme.split(MARKER, 1)[1]
    m = re.search(r"```bash\n(.*?)```", after, re.S)
    assert m, f"no ```bash block after {MARKER}"
    return m.group(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not (REPO / ".venv/bin/activate").exists(),
                    reason="the quick start activates the repository's .venv (make setup)")
def test_readme_quickstart_runs_as_written(tmp_path: Path) -> None:
    block = quickstart_block((REPO / "README.md").read_text())
    assert "agentserving up" in block and "8080" in block and "runs/quickstart" in block
    run_dir = tmp_path / "quickstart"
    script = block.replace("8080", str(_free_port())).replace("runs/quickstart", str(run_dir))
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTSERVING_")}
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    usages = [ast.literal_eval(line) for line in proc.stdout.splitlines()
              if line.startswith("{")]
    assert len(usages) == 2, proc.stdout
    first, second = usages
    assert first["prompt_tokens"] == second["prompt_tokens"] > 256
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    # the second turn of the session reuses the first's KV: every whole 256-token chunk
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert cached == second["prompt_tokens"] // 256 * 256, second
    # the fleet it started is gone: `kill %1; wait` stopped `up`, and `up` its processes
    fleet = json.loads((run_dir / "fleet.json").read_text())
    for p in fleet["processes"]:
        with pytest.raises(ProcessLookupError):
            os.kill(p["pid"], 0)
