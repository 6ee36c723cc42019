"""The import graph of functree's own modules: layered, with no circles.

Every ``import`` statement of every module under ``functree/`` is read with ``ast`` (at
module level and inside functions alike: a lazy import is still a dependency); imports
under ``if TYPE_CHECKING:`` are left out (they run nothing: how a callback names the
``Trainer`` it is given). An edge goes to the module an import names: ``from functree.nn
import Dense`` to the package ``functree.nn``, ``from functree.optim import _subset`` to
``functree.optim._subset``, ``import functree.nn._state`` to ``functree.nn._state``.

* The core (``functree/_*.py``) imports nothing from the subpackages ``nn``, ``optim``,
  ``train``, ``parallel`` and ``losses``: they build on it, never the reverse.
* No module reaches itself through its imports (no cycle, of any length).
* No two packages import each other, even through other modules: the core and the
  subpackages form layers (``functree/__init__.py`` and ``__main__``, which put them
  together, are above all of them).
* ``ft.nn`` holds layers: no module under ``functree/nn/`` imports transformers, torch,
  safetensors or peft, nor a package built on it, with two exceptions, both edges of the
  graph here: ``functree.nn``'s names of :data:`functree.nn.ELSEWHERE` (``ft.nn.from_hf``:
  looked up in ``functree.hf`` on first use) and ``functree.nn._hf_models`` and
  ``_hf_config``, the recorded names of the Hugging Face classes that pickles import
  (nothing in functree imports them). The layer tests leave these out, and the one upward
  edge of ``functree.parallel``: its older names of the mesh steps
  (:data:`functree.parallel.ELSEWHERE`, ``ft.parallel.DataParallelStep``), looked up in
  ``functree.train`` on first use.
* ``import functree`` imports the core alone: each subpackage on its first read.
"""

from __future__ import annotations

import ast
import functools
import importlib
import pathlib
import sys

import _devices
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "functree"
SUBPACKAGES = ("nn", "optim", "train", "parallel", "losses", "hf", "generation", "interop")


def _module_name(path: pathlib.Path) -> str:
    parts = ("functree", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _statements(tree: ast.AST):
    """Every import statement of ``tree``, at any depth, outside ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            yield from (s for child in node.orelse for s in _statements(child))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _statements(node)


def _base(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def imports(module: str) -> set[str]:
    """The functree modules ``module`` imports (see the module docstring)."""
    found = set()
    for node in _statements(ast.parse(MODULES[module].read_text(), str(MODULES[module]))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        else:
            base = _base(module, node)
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names}
    return {m for m in found if m in MODULES and m != module}


# The two upward edges of ft.nn (module docstring): the layer tests leave them out.
UPWARD = {("functree.nn", "functree.hf"), ("functree.nn", "functree.generation"), ("functree.nn", "functree.interop"),
          ("functree.nn._hf_models", "functree.hf._models"), ("functree.nn._hf_config", "functree.hf._config")}
# ...and the one of ft.parallel: its older names of the mesh steps.
PARALLEL_UPWARD = {("functree.parallel", "functree.train._step_factories")}


@functools.cache
def graph() -> dict[str, set[str]]:
    """Every module's imports, read when a test first asks (not while pytest collects: every
    worker collects this file, and reading ~200 modules' syntax trees took seconds)."""
    found = {m: imports(m) for m in MODULES}
    # ft.nn's and ft.parallel's names that live in the packages above them, looked up on
    # first use (importlib: an edge the statements above do not show).
    for package in ("functree.nn", "functree.parallel"):
        found[package] |= set(importlib.import_module(package).ELSEWHERE.values())
    return found


@functools.cache
def layered() -> dict[str, set[str]]:
    """:func:`graph` without the upward edges of ft.nn and ft.parallel (:data:`UPWARD`,
    :data:`PARALLEL_UPWARD`)."""
    return {m: {d for d in deps if (m, d) not in UPWARD | PARALLEL_UPWARD} for m, deps in graph().items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _path(graph: dict[str, set[str]], start: str, component: list[str]) -> list[str]:
    """One circle through ``start`` inside ``component`` (breadth first), for the message."""
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & set(component)):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    return component


def test_the_graph_sees_module_level_function_level_and_relative_imports():
    assert "functree._tree" in graph()["functree._paths"]
    assert "functree.nn" in graph()["functree.train._setup"]  # from functree import nn
    assert "functree.parallel" in graph()["functree.train.checkpoint._arrays"]  # inside a function
    assert "functree.nn._dropout" in graph()["functree.nn"]  # the package's own re-exports
    assert not any("functree.train._trainer" in graph()[m] for m in ("functree.train._callbacks",))  # TYPE_CHECKING


def test_core_modules_import_no_subpackage():
    core = [m for m in MODULES if m.count(".") == 1 and m.startswith("functree._") and not m.endswith("__")]
    assert "functree._tree" in core and "functree.nn" not in core and "functree.__main__" not in core
    upward = {m: sorted(d for d in graph()[m] if d == "functree" or d.split(".")[1] in SUBPACKAGES) for m in core}
    assert {m: d for m, d in upward.items() if d} == {}


def test_no_module_imports_itself_through_others():
    circles = [" -> ".join(_path(layered(), c[0], c)) for c in _cycles(layered())]
    assert circles == []


def test_nn_points_up_only_by_its_documented_names():
    """``ft.nn``'s only imports of the packages built on it are :data:`UPWARD`'s; each
    name of ``functree.nn.ELSEWHERE`` is that package's own object, and ``_hf_models``
    re-exports every recorded class (a pickle written before the move loads it)."""
    import functree as ft
    from functree.hf import _models

    above = ("functree.hf", "functree.generation", "functree.interop")
    upward = {(m, d) for m, deps in graph().items() if m.startswith("functree.nn")
              for d in deps if d.startswith(above)}
    assert upward == UPWARD
    for name, home in ft.nn.ELSEWHERE.items():
        assert getattr(ft.nn, name) is getattr(sys.modules[home], name) and name in ft.nn.__all__
        assert name in dir(ft.nn)
    recorded = sys.modules["functree.nn._hf_models"] if "functree.nn._hf_models" in sys.modules else \
        __import__("functree.nn._hf_models").nn._hf_models
    assert all(getattr(recorded, cls.__name__) is cls for cls in _models.RECORDED)
    from functree.hf._config import HFConfig

    assert HFConfig.__module__ == "functree.nn._hf_config"
    assert __import__("functree.nn._hf_config").nn._hf_config.HFConfig is HFConfig
    with pytest.raises(AttributeError, match="no attribute 'from_hff'"):
        ft.nn.from_hff  # noqa: B018


def test_nn_imports_no_model_porting_library():
    """No module under ``functree/nn/`` imports transformers, torch, safetensors or peft."""
    porting = {"transformers", "torch", "safetensors", "peft"}
    found = {}
    for module, path in MODULES.items():
        if module.startswith("functree.nn"):
            tree = ast.parse(path.read_text(), str(path))
            names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            names |= {n.module.split(".")[0] for n in ast.walk(tree)
                      if isinstance(n, ast.ImportFrom) and n.module and not n.level}
            if names & porting:
                found[module] = sorted(names & porting)
    assert found == {}


def _package(module: str) -> str | None:
    """The layer of ``module``: "core", a subpackage's name, or None for the top package."""
    part = module.split(".")[1] if "." in module else "__init__"
    if part in ("__init__", "__main__"):
        return None
    return "core" if part.startswith("_") else part


def test_no_two_packages_import_each_other():
    layers: dict[str, set[str]] = {}
    for module, deps in layered().items():
        a = _package(module)
        if a is not None:
            layers.setdefault(a, set()).update(b for d in deps if (b := _package(d)) not in (None, a))
    assert set(layers) == {"core", *SUBPACKAGES}
    assert layers["core"] == set()
    circles = [" -> ".join(_path(layers, c[0], c)) for c in _cycles(layers)]
    assert circles == []


def test_cycle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _path(graph, "a", ["a", "b", "c"]) == ["a", "b", "c", "a"]


def test_only_the_naming_module_matches_names_with_globs():
    """Issue 21: one naming layer. Every pattern over parameter names goes through
    ``functree/_naming.py``; no other module imports ``fnmatch`` to glob names itself."""
    def external(module: str) -> set[str]:
        tree = ast.parse(MODULES[module].read_text(), str(MODULES[module]))
        nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
        return {a.name.split(".")[0] for n in nodes if isinstance(n, ast.Import) for a in n.names} | {
            n.module.split(".")[0] for n in nodes if isinstance(n, ast.ImportFrom) and n.module and not n.level}

    globbing = sorted(m for m in MODULES if "fnmatch" in external(m))
    assert globbing == ["functree._naming"]


def test_import_functree_loads_no_checkpoint_or_porting_library(fresh):
    """``import functree`` (time to the first result, issue 47) imports neither orbax (0.3-0.4 s
    on the 2-core CI machine: loaded on the first checkpoint save or load) nor transformers,
    torch, safetensors or peft (loaded only where a Hugging Face object or torch tensor is
    given). A fresh process (this one has imported them already): the one of
    test_import_functree_imports_the_core_alone, read right after its ``import functree``."""
    assert fresh["heavy"] == [], f"import functree imported {fresh['heavy']}"


# What ``import functree`` leaves unimported: every subpackage (imported on its first read:
# ``ft.nn``, ``import functree.nn``, ``from functree.train import save``), optax (with
# ``ft.optim``) and ``jax.extend`` (it imports Pallas: with ``ft.nn``, or the first jaxpr
# a diagnostic walks).
LAZY = (*(f"functree.{p}" for p in SUBPACKAGES), "optax", "jax.extend")
# ... nor a checkpoint or porting library (the test above).
HEAVY = ("orbax", "transformers", "torch", "safetensors", "peft")

# The subprocess of the test below: what ``import functree`` loaded; the readers of foreign
# names once ``ft.nn.from_hf`` is read (``functree.hf`` registers Hugging Face's as it is
# imported: ``ft.nn.lora(model, "model.layers.*.q_proj")``); every public name of functree
# and its subpackages, each package's ``dir``, the older names of the mesh steps, and a
# checkpoint's public type names (the registry is handed the packages' names by
# ``functree.train``, now that ``import functree`` no longer imports it).
FRESH = f"""
import sys, tempfile, functree as ft
loaded = sorted(m for m in {LAZY!r} if m in sys.modules)
heavy = sorted(m for m in {HEAVY!r} if m in sys.modules)
ft.nn.from_hf
from functree import _naming
foreign = [read.__module__ for read in _naming.FOREIGN_NAMES]
missing = []
for package in [ft, *(getattr(ft, p) for p in {SUBPACKAGES!r})]:
    for name in package.__all__:
        try:
            getattr(package, name)
        except AttributeError:
            missing.append(package.__name__ + "." + name)
    missing += [package.__name__ + "." + name + " (dir)" for name in package.__all__ if name not in dir(package)]
from functree.train import save
from functree.parallel import DataParallelStep
from functree.train._step_factories import DataParallelStep as defined
model = ft.nn.Dense(2, 3, key=jax.random.key(0))
state = ft.optim.Optimizer(ft.optim.adam(1e-3)).init(model)
with tempfile.TemporaryDirectory() as directory:
    save(directory + "/c", (model, state))
    loaded_model, loaded_state = ft.train.load(directory + "/c")
from functree.train.checkpoint import _registry
report(dict(loaded=loaded, heavy=heavy, foreign=foreign, missing=missing, same_step=DataParallelStep is defined,
            types=[type(loaded_model).__name__, type(loaded_state).__name__],
            names=[_registry.type_name(type(model)), _registry.type_name(type(state))]))
"""


@pytest.fixture(scope="module")
def fresh():
    """What :data:`FRESH` reported: one fresh process for the two tests that read it (a
    process of its own per test was ~1.5 CPU-s more: Python, JAX and functree's imports)."""
    return _devices.run(FRESH, devices=1)


def test_import_functree_imports_the_core_alone(fresh):
    """``import functree`` (time to the first result: every test subprocess and notebook
    kernel pays it) runs the core alone: 0.035 CPU-s over ``import jax`` with bytecode
    cached, against 0.24 s over ``import jax, optax`` when it imported every subpackage.
    Each is imported on its first read, and the public API is unchanged: every name of each
    ``__all__`` resolves and is in ``dir``, a checkpoint stores the public type names and
    rebuilds the types without a template. A fresh process (this one has imported them all)
    whose XLA_FLAGS append to the inherited ones (``_devices``)."""
    got = fresh
    assert got["loaded"] == [], f"import functree imported {got['loaded']}: read them on first use"
    assert got["foreign"] == ["functree.hf._names"]  # registered with from_hf: ft.nn.lora reads HF names
    assert got["missing"] == []
    assert got["same_step"] is True
    assert got["types"] == ["Dense", "OptimizerState"]
    assert got["names"] == ["functree.nn.Dense", "functree.optim.OptimizerState"]
