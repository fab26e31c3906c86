"""The package's layers, as imports: what each top-level package may import, read from the
source (every import statement, function-level ones included, and the module paths handed to
``importlib``), so a new edge that breaks the layering fails here rather than in an image that
lacks a dependency. docs/architecture.md draws the same layers.

Reading the source, not ``sys.modules``, is deliberate: a function-level import is an edge as
real as a module-level one (it runs when that code path does), and it is the kind that hides.
``core/tests/test_packaging.py`` checks the other half: importing the light services loads no
torch.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# setup.py's map from import name to folder (kept equal by test_every_folder_is_a_layer)
FOLDERS = {"core": "core", "kvindex": "services/kvindex", "operator": "operator",
           "engine": "engine", "prefill": "services/prefill", "decode": "services/decode",
           "proxy": "services/proxy", "replay": "replay", "kernels": "kernels", "sim": "sim"}
WORKER = {"engine", "prefill", "decode"}  # one process image: the worker's three folders
# What each package may import besides itself. Lower layers never import higher ones:
# core (contracts, hashing, clients) < kernels < the services < the operator < the tools.
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "kernels": {"core"},
    "kvindex": {"core"},  # the proxy and the kvindex talk over HTTP, through core's clients
    "proxy": {"core"},
    # the roles' code (prefill's policies, the P/D hand-off in decode/handoff) is below the
    # engine, which composes it by role: neither role imports the engine or the other role
    "prefill": {"core", "kernels"},
    "decode": {"core", "kernels"},
    "engine": {"core", "kernels", "prefill", "decode"},
    # the operator renders the services' command lines from their own settings and CLIs
    "operator": {"core", "kvindex", "proxy", "engine", "prefill"},
    "replay": {"core", "kernels", "kvindex", "proxy"} | WORKER,
    "sim": {"core", "kernels", "kvindex", "proxy", "replay"} | WORKER,
}
HEAVY = {"torch", "transformers", "lmcache", "vllm"}  # not in the light images
HEAVY_ALLOWED = WORKER | {"kernels", "sim"}  # sim: calibration against the real engine
# (file, module) edges allowed past the rules above, each for a stated reason
EXCEPTIONS = {
    # the console script's subcommand table names every CLI; each loads only when invoked
    **{("core/cli.py", pkg): "the `agentserving` command's lazy subcommand table"
       for pkg in ("kvindex", "operator", "engine", "proxy", "replay", "sim")},
    # LMCache's controller messages, imported only when --lmcache-controller is on
    ("services/kvindex/ingest/lmcache_controller.py", "lmcache"): "LMCache's wire format",
}
MODULE_PATH = re.compile(r"^agentserving\.(\w+)(?:\.\w+)*(?::\w+)?$")


@dataclass(frozen=True)
class Edge:
    file: str  # relative to the repository root
    line: int
    target: str  # a package of FOLDERS, or a top-level third-party module

    def __str__(self) -> str:
        return f"{self.file}:{self.line} -> {self.target}"


def product_files(folder: str) -> Iterator[Path]:
    for path in sorted((ROOT / folder).rglob("*.py")):
        parts = path.relative_to(ROOT / folder).parts
        if "tests" not in parts and path.name != "conftest.py":
            yield path


def _target(module: str) -> str:
    head, _, rest = module.partition(".")
    return rest.split(".")[0] if head == "agentserving" and rest else head


def edges_of(path: Path, root: Path = ROOT) -> Iterator[Edge]:
    """Imports of ``path``: statements anywhere in it, ``importlib.import_module`` /
    ``__import__`` calls, and, in a file that calls them, every string naming a module of
    the package (``MODULE = "agentserving.prefill.policies"``)."""
    rel = str(path.relative_to(root))
    tree = ast.parse(path.read_text(), filename=rel)
    dynamic = False
    strings: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Edge(rel, node.lineno, _target(alias.name))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield Edge(rel, node.lineno, _target(node.module))
        elif isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
            dynamic = dynamic or name in ("import_module", "__import__")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            strings.append((node.lineno, node.value))
    if dynamic:
        for line, text in strings:
            if m := MODULE_PATH.match(text):
                yield Edge(rel, line, m.group(1))


def package_edges(pkg: str) -> list[Edge]:
    return [e for path in product_files(FOLDERS[pkg]) for e in edges_of(path)
            if e.target != pkg]


def test_every_folder_is_a_layer():
    setup = (ROOT / "setup.py").read_text()
    mapped = dict(re.findall(r'"agentserving\.(\w+)": "([\w/]+)"', setup))
    assert mapped == FOLDERS and set(ALLOWED) == set(FOLDERS)


def test_edges_are_read_from_every_kind_of_import(tmp_path):
    """The reader itself: each kind of import it must see, in a file of its own."""
    src = tmp_path / "mod.py"
    src.write_text("import torch\nfrom agentserving.engine.x import y\n"
                   "def f():\n    from agentserving.proxy import z\n"
                   "import importlib\nMOD = 'agentserving.prefill.policies'\n"
                   "importlib.import_module(MOD)\n")
    found = {(e.line, e.target) for e in edges_of(src, tmp_path)}
    assert {(1, "torch"), (2, "engine"), (4, "proxy"), (6, "prefill"),
            (5, "importlib")} <= found


@pytest.mark.parametrize("pkg", sorted(FOLDERS))
def test_a_package_imports_only_the_layers_below_it(pkg):
    bad = [e for e in package_edges(pkg) if e.target in FOLDERS
           and e.target not in ALLOWED[pkg] and (e.file, e.target) not in EXCEPTIONS]
    assert not bad, f"{pkg} may import {sorted(ALLOWED[pkg])}; found:\n" + \
        "\n".join(map(str, bad))


@pytest.mark.parametrize("pkg", sorted(set(FOLDERS) - HEAVY_ALLOWED))
def test_light_packages_never_import_torch_or_the_engines(pkg):
    bad = [e for e in package_edges(pkg) if e.target in HEAVY
           and (e.file, e.target) not in EXCEPTIONS]
    assert not bad, f"{pkg} runs in an image without {sorted(HEAVY)}; found:\n" + \
        "\n".join(map(str, bad))


def test_every_exception_is_still_needed():
    """An exception the code no longer needs is a hole in the contract: it goes."""
    seen = {(e.file, e.target) for pkg in FOLDERS for e in package_edges(pkg)}
    assert set(EXCEPTIONS) <= seen, sorted(set(EXCEPTIONS) - seen)


@pytest.mark.parametrize("pkg", sorted(FOLDERS))
def test_no_product_package_imports_the_test_kit(pkg):
    """``testkit`` (servers, fake workers, the vLLM test environment) is installed by
    ``make setup`` only: an image or wheel that imported it would fail at the first call."""
    bad = [e for e in package_edges(pkg) if e.target == "testkit"]
    assert not bad, f"{pkg} imports the test kit:\n" + "\n".join(map(str, bad))
