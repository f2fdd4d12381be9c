"""comm/'s import graph runs one way: backends, then the strategies' base, then one module per
strategy, then `auto`, then the registry. Read from the source with `ast`, nothing imported:

- no `import` inside a function or method (a hidden import is how a circle stays unnoticed),
  except optional third-party modules that are imported only when used;
- no cycle among comm's modules (module-level imports);
- each layered module imports only layers below its own (auto's modules may import each other).
"""

from __future__ import annotations

import ast
from pathlib import Path

import gradwire.comm

COMM = Path(gradwire.comm.__file__).parent
PACKAGE = "gradwire.comm"
OPTIONAL = {"mpi4py", "horovod", "cupy"}  # optional dependencies: imported where used
BOTTOM, BACKENDS, BASE, STRATEGIES, AUTO, REGISTRY, CONFIG, ENTRY = range(8)
LAYERS = {
    "backend": BOTTOM, "framing": BOTTOM, "links": BOTTOM,
    "torch_dist": BACKENDS, "mpi": BACKENDS, "horovod": BACKENDS,
    "base": BASE,
    # the strategies, and the plain-MPI API's sparse exchange beside them
    "dense": STRATEGIES, "allgather": STRATEGIES, "artopk": STRATEGIES, "oktopk": STRATEGIES,
    "powersgd": STRATEGIES, "hierarchical": STRATEGIES, "reduce_scatter": STRATEGIES, "sparse_exchange": STRATEGIES,
    "auto": AUTO, "auto.probe": AUTO, "auto.policy": AUTO, "auto.turns": AUTO, "auto.uncompressed": AUTO,
    "auto.strategy": AUTO,
    "registry": REGISTRY,
    # what the entry points share (one config), and the plain-loop entry point itself
    "config": CONFIG, "api": ENTRY,
}


def _modules() -> dict[str, Path]:
    """Module name (relative to gradwire.comm, packages by their own name) -> file."""
    out = {}
    for path in sorted(COMM.rglob("*.py")):
        parts = list(path.relative_to(COMM).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return name == "" or modules[name].name == "__init__.py"


def _targets(name: str, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> list[str]:
    """The comm modules an import statement of module `name` loads ("" is gradwire.comm itself)."""
    if isinstance(node, ast.Import):
        full = [a.name for a in node.names]
    else:
        if node.level:
            here = ([PACKAGE] + name.split(".")) if name else [PACKAGE]
            if not _is_package(name, modules):
                here = here[:-1]
            base = here[: len(here) - (node.level - 1)]
            stem = ".".join(base + ([node.module] if node.module else []))
        else:
            stem = node.module or ""
        # `from package import module` loads the module; `from module import name` the module
        full = [f"{stem}.{a.name}" if f"{stem}.{a.name}"[len(PACKAGE) + 1:] in modules else stem for a in node.names]
    out = []
    for f in full:
        if f == PACKAGE:
            out.append("")
        elif f.startswith(PACKAGE + "."):
            out.append(f[len(PACKAGE) + 1:])
    return out


def _imports_in_functions(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    roots = {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom):
                    roots = {node.module.split(".")[0]} if node.level == 0 and node.module else {"(relative)"}
                else:
                    continue
                if not roots <= OPTIONAL:
                    found.append((node.lineno, ast.unparse(node)))
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        in_functions = {id(n) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                        for n in ast.walk(fn)}
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in in_functions:
                edges.update(t for t in _targets(name, node, modules) if t != name)
        graph[name] = edges
    return graph


def test_no_imports_inside_functions() -> None:
    hidden = {}
    for name, path in _modules().items():
        found = _imports_in_functions(ast.parse(path.read_text(), filename=str(path)))
        if found:
            hidden[str(path.relative_to(COMM))] = found
    assert not hidden, f"imports inside functions in gradwire/comm: {hidden}"


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path of module names, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def test_the_import_graph_has_no_cycle() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle in gradwire/comm: " + " -> ".join(c or "gradwire.comm" for c in cycle)


def test_each_layer_imports_only_layers_below() -> None:
    graph = _graph()
    missing = set(LAYERS) - set(graph)
    assert not missing, f"layered modules not found: {sorted(missing)}"
    wrong = []
    for name, layer in LAYERS.items():
        for target in graph[name]:
            below = target in LAYERS and (LAYERS[target] < layer or LAYERS[target] == layer == AUTO)
            if not below:
                wrong.append(f"{name} -> {target or 'gradwire.comm'}")
    assert not wrong, f"imports that go up or sideways: {wrong}"


def test_the_checks_see_a_cycle_and_a_hidden_import() -> None:
    """The checks above can fail: a planted cycle and a planted function-level import are found."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    planted = ast.parse("def f():\n    from .registry import make_strategy\n    from mpi4py import MPI\n")
    assert _imports_in_functions(planted) == [(2, "from .registry import make_strategy")]
    graph = _graph()
    assert "backend" in graph["torch_dist"] and "base" in graph["dense"]  # the edges are read at all


def test_old_paths_reexport_the_new_homes() -> None:
    """strategies.py, cost.py, turns.py, uncompressed.py and sparse.py hand out the very objects of
    their new homes for one release, each with a DeprecationWarning."""
    import importlib
    import sys
    import warnings

    from gradwire.comm import allgather, artopk, auto, base, dense, links, oktopk, sparse_exchange

    def old(name: str):  # imported afresh: each old path warns once, naming its new home
        sys.modules.pop(f"gradwire.comm.{name}", None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module(f"gradwire.comm.{name}")
        assert [w.category for w in caught] == [DeprecationWarning], name
        assert "next release" in str(caught[0].message), name
        return module

    strategies, cost, turns, uncompressed = (old(n) for n in ("strategies", "cost", "turns", "uncompressed"))

    assert (strategies.Allgather, strategies.Allreduce, strategies.DenseAllreduce, strategies.ARTopK) == \
        (allgather.Allgather, dense.Allreduce, dense.DenseAllreduce, artopk.ARTopK)
    assert (strategies.Strategy, strategies.ExchangeStats, strategies.Segment, strategies.segments_of,
            strategies.split_message) == (base.Strategy, base.ExchangeStats, base.Segment, base.segments_of,
                                          base.split_message)
    assert (cost.CostModel, cost.Auto, cost.prefer, cost.TRIAL_MARGIN, cost.worth_compressing, cost.oktopk_seconds) \
        == (links.CostModel, auto.Auto, auto.prefer, auto.TRIAL_MARGIN, base.worth_compressing, oktopk.oktopk_seconds)
    assert turns.TimedTurns is auto.TimedTurns and uncompressed.FasterUncompressed is auto.FasterUncompressed
    sys.modules.pop("gradwire.comm.sparse", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sparse = importlib.import_module("gradwire.comm.sparse")
    assert [w.category for w in caught] == [DeprecationWarning] and "sparse_exchange" in str(caught[0].message)
    assert (sparse.sparse_allgather, sparse.merge_dense, sparse.merge_sparse) == \
        (sparse_exchange.sparse_allgather, sparse_exchange.merge_dense, sparse_exchange.merge_sparse)


#: gradwire's packages from the bottom up: each imports only packages listed before it
PACKAGE_LAYERS = ["errors", "cuda", "compress", "comm", "hooks", "integrations", "experiments"]


def test_packages_import_only_packages_below() -> None:
    """cuda <- compress <- comm <- hooks <- integrations <- experiments, at module level and inside functions."""
    root = COMM.parent
    wrong = []
    for path in sorted(root.rglob("*.py")):
        top = path.relative_to(root).parts[0].removesuffix(".py")
        if top not in PACKAGE_LAYERS:
            continue  # the command line and bench sit above everything
        allowed = set(PACKAGE_LAYERS[: PACKAGE_LAYERS.index(top) + 1])
        depth = len(path.relative_to(root).parts) - 1  # how many dots reach gradwire/ from this module
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level:
                if node.level <= depth:
                    continue  # inside its own package
                target = (node.module or "").split(".")[0] or node.names[0].name
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gradwire."):
                target = node.module.split(".")[1]
            elif isinstance(node, ast.Import):
                names = [a.name.split(".")[1] for a in node.names if a.name.startswith("gradwire.")]
                if not names:
                    continue
                target = names[0]
            else:
                continue
            if target in PACKAGE_LAYERS and target not in allowed:
                wrong.append(f"{path.relative_to(root)}:{node.lineno} imports {target}")
    assert not wrong, f"imports that go up a layer: {wrong}"
