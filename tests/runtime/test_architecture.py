"""The code's layering: the FAB carries the runtime only, the runtime never imports the
tooling (florg_tools: launcher, deploy, asset fetcher, flwr-home writer), and neither
imports the lab (lab/florg_lab: the experiment grids and their tools, a package of its own)."""

from __future__ import annotations

import ast
import fnmatch
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNTIME_PACKAGES = ("flower_app", "client_app", "server_app", "strategies")
TOOLING = "florg_tools"
LAB = "florg_lab"  # lab/florg_lab, installed apart (lab/pyproject.toml)


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _imported_names(path: Path) -> set[str]:
    """Every module an import statement of ``path`` names, function-local imports included."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_no_runtime_module_imports_the_tooling():
    offenders = [
        f"{path.relative_to(ROOT)} imports {name}"
        for package in RUNTIME_PACKAGES
        for path in _modules(package)
        for name in _imported_names(path)
        if name == TOOLING or name.startswith(TOOLING + ".")
    ]
    assert not offenders, offenders


def test_neither_the_runtime_nor_the_tooling_imports_the_lab():
    """``pip install .`` gives the app and its tooling without the lab: nothing there
    imports it (``florg experiments`` names it as a string, loaded when it runs), and the
    root package's setuptools selection leaves it out."""
    offenders = [
        f"{path.relative_to(ROOT)} imports {name}"
        for package in (*RUNTIME_PACKAGES, TOOLING)
        for path in _modules(package)
        for name in _imported_names(path)
        if name.split(".")[0] == LAB
    ]
    assert not offenders, offenders
    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert not [p for p in found["packages"]["find"]["include"] if p.startswith(LAB)]
    assert (ROOT / "lab" / LAB / "__init__.py").is_file() and not (ROOT / LAB).exists()


def test_the_tooling_never_imports_the_test_machinery():
    """The test machinery (the ``ci`` package at the repository root, the harnesses in
    ``tests``) builds on the tooling, never the other way: neither is installed with the
    tooling, nor in the FAB or the app image."""
    offenders = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in _modules(TOOLING)
        for name in _imported_names(path)
        if name.split(".")[0] in ("ci", "tests")
    ]
    assert not offenders, offenders


def test_importing_both_apps_loads_no_tooling_or_lab_module():
    code = (
        "import sys, client_app.client_app, server_app.server_app; "
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {(TOOLING, LAB)!r}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_the_fab_include_patterns_match_runtime_files_only():
    app = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    files = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*") if p.is_file()]
    files = [f for f in files if not f.startswith((".venv/", ".git/"))]
    included = {f for f in files for pat in app["fab-include"] if fnmatch.fnmatch(f, pat)}
    assert any(f.startswith("flower_app/") for f in included)
    assert not [f for f in included if f.startswith(TOOLING + "/")]
    top = {f.split("/")[0] for f in included}
    assert top <= set(RUNTIME_PACKAGES), top


GRAPH_PACKAGES = (*RUNTIME_PACKAGES, TOOLING)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(
    tree: ast.AST, type_checking: bool = False, skip_functions: frozenset[str] = frozenset()
):
    """Every node of ``tree`` except the bodies of ``if TYPE_CHECKING:`` (annotations
    only, never run), which ``type_checking`` includes too, and of the functions named in
    ``skip_functions``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.FunctionDef) and node.name in skip_functions:
            continue
        if _is_type_checking(node) and not type_checking:
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))


def import_graph(
    packages: tuple[str, ...] = GRAPH_PACKAGES,
    type_checking: bool = False,
    skip_functions: frozenset[str] = frozenset(),
) -> dict[str, set[str]]:
    """module -> the modules of ``packages`` it imports, function-local imports included,
    ``if TYPE_CHECKING:`` imports only with ``type_checking`` (they never run); ``from pkg
    import mod`` imports ``pkg.mod`` when that is a module (else ``pkg``)."""
    paths = {_module_name(p): p for package in packages for p in _modules(package)}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        tree = ast.parse(path.read_text(), str(path))
        for node in _runtime_nodes(tree, type_checking, skip_functions):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package, up level - 1
                    package = name.split(".") if is_package else name.split(".")[:-1]
                    package = package[: len(package) - (node.level - 1)]
                    base = ".".join([*package, base] if base else package)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    edges.add(sub if sub in paths else base)
        graph[name] = {e for e in edges if e in paths and e != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (``[a, b, ..., a]``), or None."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path, on_path = [start], {start}
        stack = [iter(sorted(graph[start]))]
        while stack:
            child = next(stack[-1], None)
            if child is None:
                stack.pop()
                done.add(path[-1])
                on_path.discard(path.pop())
            elif child in on_path:
                return [*path[path.index(child) :], child]
            elif child not in done:
                path.append(child)
                on_path.add(child)
                stack.append(iter(sorted(graph[child])))
    return None


def test_find_cycle_finds_a_cycle_and_accepts_a_dag():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_import_graph_sees_function_local_and_from_imports():
    graph = import_graph()
    # the method builds the common strategy, which reads it through a Protocol (no import)
    assert (
        "strategies.shared.base_method"
        not in import_graph(type_checking=True)["strategies.server.strategy"]
    )
    assert "strategies.server.strategy" in graph["strategies.shared.base_method"]
    # base_method.py imports AdapterStrategy for annotations under TYPE_CHECKING
    assert (
        "strategies.server.strategy"
        in import_graph(type_checking=True)["strategies.shared.base_method"]
    )
    assert "flower_app.settings.config" in graph["server_app.server_app"]
    # a function-local import (flower_app/cache/disk.py: cache_root)
    assert "flower_app.cache.assets" in graph["flower_app.cache.disk"]
    assert len(graph) > 40


def test_the_import_graph_has_no_cycle():
    """Over flower_app, client_app, server_app, strategies and florg_tools, function-local
    imports included: a cycle hidden inside functions still couples the modules both ways.
    Show it: python -c "from tests.runtime.test_architecture import *;
    print(find_cycle(import_graph()))" prints None or the cycle."""
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def reachable(graph: dict[str, set[str]], start: set[str]) -> set[str]:
    """Every module some module of ``start`` imports, directly or not."""
    seen: set[str] = set()
    stack = list(start)
    while stack:
        for child in graph[stack.pop()]:
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return seen


def test_the_core_never_imports_the_methods():
    """Nothing in flower_app imports strategies/, annotations (``if TYPE_CHECKING:``) and
    function-local imports included: the core owns the method contract and the registry
    (flower_app/methods/), and the method folders register themselves
    (strategies/registry.py), imported by the apps and the tooling."""
    graph = import_graph(type_checking=True)
    offenders = [
        f"{module} -> {imported}"
        for module, imports in graph.items()
        if module.split(".")[0] == "flower_app"
        for imported in imports
        if imported.split(".")[0] == "strategies"
    ]
    assert not offenders, offenders
    assert "strategies.registry" in graph["client_app.client_app"]
    assert "strategies.registry" in graph["server_app.server_app"]


def test_settings_and_methods_depend_one_way():
    """flower_app/settings/config.py reads the method registry (the values of ``method``, the
    methods' own settings); nothing a method imports, annotations (``if TYPE_CHECKING:``)
    and function-local imports included, reaches the run config that composes them (the
    config.py docstring says why this way). A method declares its settings with the
    declaration's tools only, ``flower_app.settings`` and ``flower_app.settings.checks``,
    which import nothing of the app."""
    graph = import_graph(type_checking=True)
    assert "flower_app.methods.registry" in graph["flower_app.settings.config"]
    methods = {"strategies.registry", "flower_app.methods.contract"} | {
        m for m in graph if m.startswith("strategies.") and m.endswith(".method")
    }
    assert len(methods) > 5
    reached = reachable(graph, methods)
    assert not reached & {"flower_app.settings.config", "flower_app.adapted"}
    for tool in ("flower_app.settings", "flower_app.settings.checks"):
        assert not {m for m in graph[tool] if m.split(".")[0] in {"flower_app", "strategies"}}


def test_the_runtime_caches_and_the_data_do_not_import_each_other_in_a_cycle():
    """The cycle of issue 14: runtime -> disk_cache -> task_data -> runtime."""
    graph = import_graph()
    assert "flower_app.task_data" not in graph["flower_app.cache.disk"]
    assert "flower_app.cache.per_process" not in graph["flower_app.task_data"]
    runtime = {m: graph[m] for m in graph if m.split(".")[0] in RUNTIME_PACKAGES}
    assert find_cycle(runtime) is None


# The runtime's two sides, by folder. The ClientApp and flower_app/client/ form the client
# side; the ServerApp, flower_app/run_output/, strategies/server/ (the common strategy's parts
# and the server's DP mechanisms) and each method's Flower strategy
# (strategies/<m>/strategy.py) form the server side. Everything else (settings, adapters,
# the method contract and registry, the methods' declarations and rules, strategies/shared/,
# task kinds, data, training, records) is the core both import.
SERVER_FOLDERS = ("server_app", "flower_app.run_output", "strategies.server")
# The contract's hooks only the server calls (flower_app/methods/contract.py, "server
# side"): what they import is left out of the client side's reach.
SERVER_HOOKS = frozenset({"build_strategy", "aggregate", "aggregate_private", "central_dp"})


def is_client_side(module: str) -> bool:
    return module.split(".")[0] == "client_app" or module.startswith("flower_app.client.")


def is_server_side(module: str) -> bool:
    return module.endswith(".strategy") or any(
        module == folder or module.startswith(folder + ".") for folder in SERVER_FOLDERS
    )


def test_the_client_side_never_imports_the_server_side_and_the_reverse():
    """Function-local imports included. A method's server hooks (``SERVER_HOOKS``) reach its
    Flower strategy and the server's mechanisms, and only the server calls them: their
    imports are left out of the client side's reach."""
    graph = import_graph()
    client = {m for m in graph if is_client_side(m)}
    server = {m for m in graph if is_server_side(m)}
    assert len(client) >= 5 and len(server) >= 10
    direct = [f"{a} -> {b}" for a in client for b in graph[a] if is_server_side(b)]
    direct += [f"{a} -> {b}" for a in server for b in graph[a] if is_client_side(b)]
    assert not direct, direct
    assert not reachable(graph, server) & client
    hooks_left_out = import_graph(skip_functions=SERVER_HOOKS)
    assert not reachable(hooks_left_out, client) & server, sorted(
        reachable(hooks_left_out, client) & server
    )


def test_a_clientapp_process_loads_no_server_module_and_the_reverse():
    code = (
        "import sys, importlib; importlib.import_module(sys.argv[1]); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('client_app', 'server_app', 'flower_app', 'strategies')))"
    )
    for app, other_side in (
        ("client_app.client_app", is_server_side),
        ("server_app.server_app", is_client_side),
    ):
        out = subprocess.run(
            [sys.executable, "-c", code, app], cwd=ROOT, capture_output=True, text=True,
            check=True,
        )  # fmt: skip
        loaded = ast.literal_eval(out.stdout)  # a printed list of module names
        assert loaded and not [m for m in loaded if other_side(m)], (app, loaded)


def test_no_runtime_module_is_longer_than_400_lines():
    long = [
        f"{path.relative_to(ROOT)}: {n} lines"
        for package in RUNTIME_PACKAGES
        for path in _modules(package)
        if (n := len(path.read_text().splitlines())) > 400
    ]
    assert not long, long


def test_a_method_is_named_only_in_its_own_folder_and_the_registry():
    """Everything else reads a method's flags and hooks from its ``Method``."""
    from strategies.registry import METHOD_FOLDERS

    offenders = []
    for folder in METHOD_FOLDERS:
        # the folder's name, its method's name and its short name (fedex, fedsa, ...); not
        # "florg" alone, the project's own name, nor "fed" alone (fed_sb's first word), the
        # first word of other methods' repositories cited in their folders (seanie12/fed-svd)
        words = {folder, folder.replace("_", "-"), folder.split("_")[0]} - {"florg", "fed"}
        if not words:  # the florg folder: its method is the project's name
            continue
        alternatives = "|".join(rf"\b{re.escape(w)}\b" for w in sorted(words))
        pattern = re.compile(alternatives, re.IGNORECASE)
        for package in RUNTIME_PACKAGES:
            for path in _modules(package):
                relative = path.relative_to(ROOT).as_posix()
                if relative.startswith(f"strategies/{folder}/") or relative == (
                    "strategies/registry.py"
                ):
                    continue
                text = path.read_text()
                offenders += [f"{relative}: {m.group(0)}" for m in pattern.finditer(text)]
    assert not offenders, offenders
