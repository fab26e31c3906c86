"""The set-up scripts take package hosts from the machine's own configuration, never a default.

A fallback host baked into the scripts would fetch from somewhere nobody configured (and fail
on a machine without that route); these run the real bash functions on a temporary apt tree
and pip configuration.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _bash(script: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env,
                          timeout=60, check=False)


def _mirror(apt_etc: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ["PATH"], "APT_ETC": str(apt_etc)}
    return _bash(f'set -euo pipefail; source "{REPO}/scripts/debian.sh"; debian_mirror', env)


DEB822 = ("sources.list.d/debian.sources",
          "Types: deb-src\nURIs: http://src.example.invalid/debian\nSuites: bookworm\n\n"
          "Types: deb\nURIs: http://mirror.example.invalid/debian\n"
          "Suites: bookworm bookworm-updates\nComponents: main\n",
          "http://mirror.example.invalid/debian")
ONE_LINE = ("sources.list",
            "# comment\ndeb-src http://src.example.invalid/debian bookworm main\n"
            "deb [signed-by=/usr/share/keyrings/k.gpg arch=amd64] "
            "http://list.example.invalid/debian bookworm main\n",
            "http://list.example.invalid/debian")


@pytest.mark.parametrize(("path", "text", "mirror"), [DEB822, ONE_LINE],
                         ids=["deb822", "one-line-with-options"])
def test_the_mirror_is_the_first_bookworm_deb_entry(tmp_path: Path, path: str, text: str,
                                                    mirror: str) -> None:
    (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / path).write_text(text)
    r = _mirror(tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == mirror


def test_no_mirror_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "sources.list").write_text("deb http://other.example.invalid/debian trixie main\n")
    r = _mirror(tmp_path)
    assert r.returncode != 0
    assert r.stdout == ""
    assert "no Debian bookworm mirror configured" in r.stderr


def _index(tmp_path: Path, extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # An isolated pip: no user, site or global configuration but the file named here.
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path),
           "PIP_CONFIG_FILE": os.devnull, "PIP_PYTHON": str(REPO / ".venv/bin/python"), **extra}
    if not Path(env["PIP_PYTHON"]).exists():
        env["PIP_PYTHON"] = "python3"
    return _bash(f'set -euo pipefail; source "{REPO}/scripts/pip-index.sh"; pip_index_url', env)


def test_index_from_pip_conf(tmp_path: Path) -> None:
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nindex-url = http://index.example.invalid/simple\n")
    r = _index(tmp_path, {"PIP_CONFIG_FILE": str(conf)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "http://index.example.invalid/simple"


def test_index_from_environment_wins(tmp_path: Path) -> None:
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nindex-url = http://index.example.invalid/simple\n")
    r = _index(tmp_path, {"PIP_CONFIG_FILE": str(conf),
                          "PIP_INDEX_URL": "http://env.example.invalid/simple"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "http://env.example.invalid/simple"


def test_index_falls_back_to_the_first_extra_index(tmp_path: Path) -> None:
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nextra-index-url = file:///srv/a/simple file:///srv/b/simple\n"
                    "find-links = /srv/wheels\n")
    r = _index(tmp_path, {"PIP_CONFIG_FILE": str(conf)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "file:///srv/a/simple"


def test_no_index_is_a_clear_error(tmp_path: Path) -> None:
    r = _index(tmp_path, {})
    assert r.returncode != 0
    assert r.stdout == ""
    assert "no pip index configured" in r.stderr
