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


# ---------------------------------------------------------------- module-level circles


def module_name(path: Path) -> str:
    """The import name of a product file (``services/proxy/app.py`` -> agentserving.proxy.app;
    a package's ``__init__.py`` is the package)."""
    pkg, folder = next((p, f) for p, f in FOLDERS.items()
                       if path.is_relative_to(ROOT / f))
    parts = [*path.relative_to(ROOT / folder).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["agentserving", pkg, *parts])


def module_imports(path: Path, modules: set[str]) -> Iterator[tuple[int, str]]:
    """(line, module of the package) for every import statement in ``path``, function-level
    and ``TYPE_CHECKING`` ones included: ``from a.b import c`` names the module ``a.b.c``
    where there is one, else ``a.b``."""
    me = module_name(path)
    here = me if path.name == "__init__.py" else me.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = here.rsplit(".", node.level - 1)[0] if node.level else ""
            mod = ".".join(filter(None, [base, node.module or ""]))
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                if sub in modules:
                    yield node.lineno, sub
                elif mod in modules:
                    yield node.lineno, mod


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {module it imports: the line of the first such import}."""
    files = [p for folder in FOLDERS.values() for p in product_files(folder)]
    modules = {module_name(p) for p in files}
    graph: dict[str, dict[str, int]] = {}
    for path in files:
        me = module_name(path)
        for line, target in module_imports(path, modules):
            if target != me:
                graph.setdefault(me, {}).setdefault(target, line)
    return graph


def two_module_circles(graph: dict[str, dict[str, int]]) -> list[tuple[str, str]]:
    """Pairs of modules that import each other (A -> B -> A), each pair once. A package
    importing its own submodule and that submodule importing the package's ``__init__`` back
    counts too: either side's import runs the other's half-initialised."""
    return sorted((a, b) for a, targets in graph.items() for b in targets
                  if a < b and a in graph.get(b, {}))


def test_module_name_and_relative_imports_are_read(tmp_path):
    path = ROOT / "services/proxy/app.py"
    assert module_name(path) == "agentserving.proxy.app"
    assert module_name(ROOT / "services/prefill/policies/__init__.py") == \
        "agentserving.prefill.policies"
    modules = {"agentserving.proxy.pods", "agentserving.proxy.routing", "agentserving.proxy"}
    found = {t for _, t in module_imports(path, modules)}
    assert "agentserving.proxy.pods" in found
    assert two_module_circles({"a": {"b": 1}, "b": {"a": 2, "c": 3}, "c": {}}) == [("a", "b")]


def test_no_two_modules_import_each_other():
    """A circle of two modules (function-level imports included: they only postpone it)
    means one holds a piece the other needs: that piece belongs in a third module both can
    import, or in the lower of the two."""
    graph = import_graph()
    circles = two_module_circles(graph)
    assert not circles, "modules that import each other:\n" + "\n".join(
        f"{a} (line {graph[a][b]}) <-> {b} (line {graph[b][a]})" for a, b in circles)
