"""The package's shape, checked: imports only run down the layers, no circles, small modules.

A layer may import from its own layer or any lower one. An import that runs back up
(a lower layer reaching a higher one) or a circle between modules means a piece was
split in the wrong place. Imports under ``if TYPE_CHECKING`` are annotations only and
are not counted.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "tiered_kv"
MAX_LINES = 400

# Lowest first. A top-level module or package not named here fails the test, so a new
# one has to be placed on purpose.
LAYERS: list[set[str]] = [
    {"errors", "sizes", "host_checks", "core", "block_ids", "redis_url", "owned_tasks", "state_lock", "media"},
    {"config", "tier_config", "formats", "layout", "layout_tensors", "keys", "identity", "capacity",
     "metrics", "byte_budget", "policy"},
    {"manager"},
    {"tiers"},
    {"transfer"},
    {"lifecycle", "loops", "cache", "cache_resources", "cache_args", "cache_sync"},
    {"cross_process"},
    {"scheduler"},
    {"integrations"},
    {"replay", "bench", "cli", "__init__", "__main__"},
]
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}


def _modules() -> dict[str, Path]:
    mods = {}
    for f in ROOT.rglob("*.py"):
        parts = f.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = f
    return mods


MODULES = _modules()


def _is_extension(module: str) -> bool:
    # Built in place or only in site-packages, depending on the install: named, not globbed.
    return module == "tiered_kv._core"


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                skip.update(id(n) for n in ast.walk(sub))
    return skip


def _imports(name: str, path: Path) -> set[str]:
    """The tiered_kv modules ``name`` imports (anywhere in the file, annotations aside)."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + (node.module.split(".") if node.module else []))
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in MODULES:
                    found.add(sub)
                elif not _is_extension(sub):  # the native core (_core.*.so) is a leaf, not its package
                    found.add(target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else "__init__"
    if top not in LAYER_OF:
        raise KeyError(f"tiered_kv.{top} is in no layer of tests/unit/test_structure.py::LAYERS; place it")
    return LAYER_OF[top]


def test_every_module_has_a_layer():
    unplaced = sorted({m.split(".")[1] for m in MODULES if "." in m} - set(LAYER_OF))
    assert not unplaced, f"place these in LAYERS: {unplaced}"


def test_no_import_runs_back_up():
    up = sorted(
        f"{src} (layer {_layer(src)}) -> {dst} (layer {_layer(dst)})"
        for src, dsts in GRAPH.items()
        for dst in dsts
        if _layer(dst) > _layer(src)
    )
    assert not up, "imports that run back up:\n" + "\n".join(up)


def _engine_imports(path: Path) -> set[str]:
    """Serving engines a file imports, anywhere in it (lazy imports included)."""
    engines = {"vllm", "sglang"}
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
        found.update(n.split(".")[0] for n in names if n.split(".")[0] in engines)
    return found


def test_the_scheduler_side_imports_no_engine():
    # tiered_kv.scheduler is what a second engine's connector reuses: an engine import there would make
    # every other engine install vLLM (or copy the module).
    engine_bound = {
        name: sorted(_engine_imports(path)) for name, path in MODULES.items() if name.startswith("tiered_kv.scheduler")
    }
    assert len(engine_bound) > 5, sorted(engine_bound)
    assert not {n: e for n, e in engine_bound.items() if e}


def test_no_circles():
    # Tarjan's strongly connected components; any component of more than one module is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    # A package's __init__ re-exporting its own submodules is not a circle of design.
    circles = [c for c in circles if not all(m.startswith(min(c, key=len)) for m in c)]
    assert not circles, f"circles: {circles}"


@pytest.mark.parametrize("path", sorted(MODULES.values()), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_is_small(path: Path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT.parent)} has {lines} lines (at most {MAX_LINES})"


# The same bound for the native core's sources and for the tests (their data files aside).
NATIVE_AND_TESTS = sorted([*(ROOT.parent / "native").glob("*.[ch]pp"), *(ROOT.parent / "tests").rglob("*.py")])


@pytest.mark.parametrize("path", NATIVE_AND_TESTS, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_native_and_test_files_are_small(path: Path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT.parent)} has {lines} lines (at most {MAX_LINES})"


def test_importing_the_errors_loads_no_heavy_dependency():
    # vLLM's plugin hook and a CLI's --help import tiered_kv.errors: the package's __init__ imports lazily.
    code = ("import sys, tiered_kv.errors, tiered_kv; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'pydantic', 'yaml', 'torch', 'numpy'}), "
            "'tiered_kv._core' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["[]", "False"], out
