"""The package's layers, read from its source: no import cycle, no import upwards, a light placement solver,
a simulator off the network.

Layers (lowest first; a module may import its own component and any lower rank, nothing else):

    0  data, infra              shipped files: traces, NATS and database configuration
    1  shared                   wire schemas, codec, bus, settings, database models and their Alembic migrations
                                (shared/db/migrations), routing-trace files
    2  solver                   pure numerics over arrays (no file, wire or database I/O)
    3  simulator                the discrete-event simulator (engine model, offline harness): shared and solver
                                only, no bus, no HTTP; below both its users, the live simulated engines
                                (engine_agents.sim.live) and the CLI (`switchyard sim`, `sim-dp`, `report`)
    4  engine_agents, services  peers: neither imports the other
    5  cli                      the entry points (`switchyard …`, `switchyard up`): they compose services and
                                simulated engines, so they alone may import both

Every `import` counts, wherever it stands (module level, inside a function, under `TYPE_CHECKING`): a cycle
that only type hints close is still a cycle a reader has to untangle. The rule is documented in
docs/architecture.md ("Layers").
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("shared", "services", "solver", "simulator", "engine_agents", "cli", "infra", "data")

#: Module prefix -> component (the longest matching prefix wins).
COMPONENT_OF_PREFIX = {
    "switchyard.data": "data",
    "switchyard.infra": "infra",
    "switchyard.shared": "shared",
    "switchyard.solver": "solver",
    "switchyard.simulator": "simulator",
    "switchyard.engine_agents": "engine_agents",
    "switchyard.services": "services",
    "switchyard.cli": "entry points",
}
#: Component -> rank. Same rank, different component: no imports either way.
RANK = {
    "data": 0,
    "infra": 0,
    "shared": 1,
    "solver": 2,
    "simulator": 3,
    "engine_agents": 4,
    "services": 4,
    "entry points": 5,
}

#: What `solver/` may not import: file, wire, database and network I/O belong to its callers.
SOLVER_IO_MODULES = {
    "aiohttp",
    "hashlib",
    "httpx",
    "io",
    "json",
    "msgpack",
    "nats",
    "os",
    "pathlib",
    "pickle",
    "shutil",
    "socket",
    "sqlalchemy",
    "tempfile",
    "zipfile",
    "switchyard.shared.bus",
    "switchyard.shared.codec",
    "switchyard.shared.db",
    "switchyard.shared.trace_files",
}
#: What `simulator/` may not import: it simulates engines, the bus and HTTP belong to the live engines above it.
SIMULATOR_NETWORK_MODULES = {
    "aiohttp",
    "fastapi",
    "httpx",
    "nats",
    "socket",
    "sqlalchemy",
    "starlette",
    "uvicorn",
    "switchyard.shared.bus",
    "switchyard.shared.db",
}
#: Calls that read or write files (`np.load`, `np.savez`, `open`, `Path.read_text`, …).
SOLVER_IO_CALLS = {"load", "save", "savez", "savez_compressed", "fromfile", "tofile", "loadtxt", "savetxt", "open"}
SOLVER_IO_METHODS = {"read_text", "read_bytes", "write_text", "write_bytes"}


def _modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its `__init__.py`)."""
    found: dict[str, Path] = {}
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(["switchyard", *parts])] = path
    return found


MODULES = _modules()


def _imported_names(module: str, path: Path) -> Iterator[tuple[str, int]]:
    """Every dotted name an import statement of the module names (`from a import b` gives `a` and `a.b`)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            yield source, node.lineno
            for alias in node.names:
                yield f"{source}.{alias.name}", node.lineno


def _resolve(name: str) -> str | None:
    """The package module a dotted name lives in (its longest prefix that is a module), or None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _graph() -> dict[str, dict[str, int]]:
    """module -> {imported package module: line of the first such import}."""
    graph: dict[str, dict[str, int]] = {}
    for module, path in MODULES.items():
        edges: dict[str, int] = {}
        for name, line in _imported_names(module, path):
            if name.split(".")[0] != "switchyard":
                continue
            target = _resolve(name)
            if target is not None and target != module:
                edges.setdefault(target, line)
        graph[module] = edges
    return graph


GRAPH = _graph()


def _component(module: str) -> str:
    prefix = max((p for p in COMPONENT_OF_PREFIX if module == p or module.startswith(p + ".")), key=len)
    return COMPONENT_OF_PREFIX[prefix]


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(graph[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = counter
                    counter += 1
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(graph[succ])))
                    advanced = True
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_graph_sees_the_package() -> None:
    """Guards the guard: the scan finds the modules and the imports the rules below are about."""
    assert {"switchyard.solver.placement", "switchyard.services.placement.service", "switchyard.shared.bus"} <= set(
        MODULES
    )
    assert "switchyard.shared.bus" in GRAPH["switchyard.services.placement.service"]
    assert _cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]
    assert _component("switchyard.cli") == _component("switchyard.cli.up") == "entry points"
    assert {"switchyard.cli.options", "switchyard.cli.fitting"} <= set(MODULES)
    assert _component("switchyard.cli.fitting") == "entry points"  # the whole CLI package
    assert _component("switchyard.services.layout") == "services"  # a prefix is a package, not a string
    with pytest.raises(ValueError):  # `switchyard.client` is no module of `switchyard.cli`
        _component("switchyard.client")
    assert _component("switchyard.services.placement.service") == "services"
    assert _component("switchyard.shared.db.migrations.env") == "shared"  # the migrations sit beside the models
    assert "switchyard.shared.db.models" in GRAPH["switchyard.shared.db.migrations.env"]
    assert set(RANK) == set(COMPONENT_OF_PREFIX.values())


def test_no_import_cycle() -> None:
    cycles = _cycles(GRAPH)
    assert not cycles, "import cycles (every import counts, TYPE_CHECKING ones too):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_no_import_from_a_higher_layer_or_a_peer() -> None:
    wrong = []
    for module, edges in GRAPH.items():
        mine = _component(module)
        for target, line in edges.items():
            theirs = _component(target)
            if theirs != mine and RANK[theirs] >= RANK[mine]:
                wrong.append(f"{MODULES[module].relative_to(REPO)}:{line} imports {target} ({mine} -> {theirs})")
    assert not wrong, "imports against the layers (see this file's docstring):\n" + "\n".join(sorted(wrong))


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("switchyard.solver")))
def test_the_solver_does_no_io(module: str) -> None:
    path = MODULES[module]
    wrong = []
    for name, line in _imported_names(module, path):
        io = next((io for io in SOLVER_IO_MODULES if name == io or name.startswith(io + ".")), None)
        if io is not None and f"line {line}: imports {io}" not in wrong:
            wrong.append(f"line {line}: imports {io}")
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            on_numpy = isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "np"
            if (called in SOLVER_IO_CALLS and (on_numpy or called == "open")) or called in SOLVER_IO_METHODS:
                wrong.append(f"line {node.lineno}: calls {called}")
    assert not wrong, f"{path.relative_to(REPO)} does I/O (its callers should):\n" + "\n".join(wrong)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("switchyard.simulator")))
def test_the_simulator_needs_no_bus_or_network(module: str) -> None:
    wrong = sorted(
        {
            f"line {line}: imports {name}"
            for name, line in _imported_names(module, MODULES[module])
            if any(name == net or name.startswith(net + ".") for net in SIMULATOR_NETWORK_MODULES)
        }
    )
    assert not wrong, f"{MODULES[module].relative_to(REPO)} talks to the network:\n" + "\n".join(wrong)


def test_importing_the_placement_solver_does_not_load_or_tools() -> None:
    """Routers, engine agents and the API import `solver.placement` for its layouts and types; OR-Tools (the
    MINLP's CP-SAT, ~0.3 s and ~100 MB) loads only when a MINLP is solved."""
    probe = (
        "import sys, switchyard.solver.placement as p; "
        "assert p.contiguous_slots is not None; "
        "print(sorted(m for m in sys.modules if m == 'ortools' or m.startswith('ortools.')))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"importing switchyard.solver.placement loaded {out.strip()}"
    # … and the MINLP is still there when asked for
    probe = "import sys, switchyard.solver.placement as p; p.solve_minlp; print('ortools' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"
