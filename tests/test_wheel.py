"""The wheel an image installs: built from the Docker build context (no git, no tests), installed
into a clean virtual environment, every module in it imports from the wheel, and the console
script starts.

An editable install hides a package left out of the wheel (it imports the source tree), and
images only ran into it at start-up (``No module named 'agentserving.engine.scheduler'``).
So the modules here must come from the clean environment: the project's own environment is
on ``PYTHONPATH`` only for third-party dependencies (its editable finder is a ``.pth`` hook,
which ``PYTHONPATH`` entries never run), and each imported module's file must lie in the
clean environment.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# What the Dockerfiles' build context leaves out (docker/*.Dockerfile.dockerignore), plus
# build outputs a local build may leave behind.
DOCKERIGNORE = REPO / "docker" / "worker.Dockerfile.dockerignore"
EXTRA_IGNORED = ("build", "dist")

# Modules that need an optional dependency the images (and this environment) do not all have,
# with the reason; every other module of the wheel must import.
NEEDS_ABSENT_DEPENDENCY = {
    "agentserving.engine.vllm.connector":
        "vLLM's KV connector base class: imported only inside vLLM images, by vLLM itself",
    "agentserving.engine.vllm.forced_logits":
        "vLLM's logits processor base class: loaded only by vLLM's engine process",
}

IMPORT_ALL = r"""
import importlib, json, sys, traceback
out = {}
for name in json.loads(sys.argv[1]):
    try:
        module = importlib.import_module(name)
        out[name] = {"file": getattr(module, "__file__", None)}
    except BaseException as exc:  # report every module, not just the first failure
        out[name] = {"error": f"{type(exc).__name__}: {exc}"}
print("\n@@" + json.dumps(out))
"""


def _ignored_names() -> list[str]:
    names = list(EXTRA_IGNORED)
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            names.append(line.removeprefix("**/"))
    return names


def _modules(wheel: Path) -> list[str]:
    out = []
    for name in zipfile.ZipFile(wheel).namelist():
        if name.startswith("agentserving/") and name.endswith(".py"):
            module = name[:-3].replace("/", ".")
            out.append(module.removesuffix(".__init__"))
    return sorted(out)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(wheel, clean venv, environment that adds only third-party packages)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(*_ignored_names()), symlinks=True)
    run = dict(check=True, capture_output=True, text=True, timeout=300)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp / "wheels"), str(src)], **run)
    [wheel] = (tmp / "wheels").glob("agentserving-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], **run)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                    "install", "--no-deps", "-q", str(wheel)], **run)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(PYTHONPATH=sysconfig.get_paths()["purelib"], PYTHONNOUSERSITE="1",
               HOME=str(tmp))  # no caches or models of this machine's user
    return wheel, venv, env, tmp


def _source_modules() -> set[str]:
    """Every module of the source tree, by setup.py's folder map (tests excluded)."""
    tree = ast.parse((REPO / "setup.py").read_text())
    folders = next(ast.literal_eval(node.value) for node in tree.body
                   if isinstance(node, ast.Assign) and node.targets[0].id == "FOLDERS")
    out = set()
    for package, folder in folders.items():
        for path in (REPO / folder).rglob("*.py"):
            rel = path.relative_to(REPO / folder).with_suffix("")
            if "tests" not in rel.parts:
                out.add(".".join((package, *rel.parts)).removesuffix(".__init__"))
    return out


def test_wheel_has_every_source_module_and_no_tests(installed):
    wheel, *_ = installed
    modules = set(_modules(wheel))
    assert _source_modules() == modules
    names = zipfile.ZipFile(wheel).namelist()
    assert "agentserving/sim/profiles/reference-cpu.yaml" in names  # sim.profile reads it
    assert "agentserving/replay/workloads/agent-mix.jsonl" in names  # bundled:agent-mix
    assert "agentserving/replay/workloads/agent-pressure.jsonl" in names  # bundled:agent-pressure


def test_every_module_imports_from_the_wheel(installed):
    wheel, venv, env, tmp = installed
    modules = _modules(wheel)
    assert set(NEEDS_ABSENT_DEPENDENCY) <= set(modules)
    proc = subprocess.run([str(venv / "bin" / "python"), "-c", IMPORT_ALL, json.dumps(modules)],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.rsplit("\n@@", 1)[1])
    failed = {m: r["error"] for m, r in result.items() if "error" in r}
    assert set(failed) == set(NEEDS_ABSENT_DEPENDENCY), failed
    for error in failed.values():
        assert error.startswith("ModuleNotFoundError") and "agentserving" not in error, error
    prefix = str(venv.resolve())
    outside = {m: r["file"] for m, r in result.items()
               if "file" in r and not str(Path(r["file"]).resolve()).startswith(prefix)}
    assert not outside, outside


def test_console_script_runs_from_the_wheel(installed):
    _, venv, env, tmp = installed
    proc = subprocess.run([str(venv / "bin" / "agentserving"), "--help"], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for sub in ("worker", "proxy", "kvindex", "operator"):
        assert f"  {sub} " in proc.stdout, proc.stdout
