"""The package's rooms stand one above the other: no import cycle among mtplxd and mtplxctl
modules, each engine room imports only the rooms its docstring allows, and the runtime path
(loading, generation, the daemon) imports no benchmark or fixture module.

The graph is read from the source with `ast`, every import counted: module level, inside
functions (lazy imports), under TYPE_CHECKING and `importlib.import_module("literal")`. Importing `a.b.c` is an edge to `a.b.c`
alone (not to the packages above it, whose `__init__` runs first either way).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Import name -> folder (pyproject maps agents/ and launchd/ under mtplxctl).
SOURCES = {"mtplxd": ROOT / "mtplxd", "mtplxctl": ROOT / "mtplxctl",
           "mtplxctl.agents": ROOT / "agents", "mtplxctl.launchd": ROOT / "launchd"}
ENGINE = "mtplxd.engine"
NOT_RUNTIME = (f"{ENGINE}.bench", f"{ENGINE}.fixtures")
# Engine room -> the engine rooms it may import (besides itself). Top-level engine modules
# (interface, generation, loaded_model, scheduler, owner) are the room "" and may import every runtime room.
ALLOWED = {
    "interface": set(),
    "model": {"interface"},
    "decoding": {"interface", "model"},
    "session": {"interface", "model"},
    "": {"", "interface", "model", "decoding", "session"},
    "distributed": {"", "interface", "model"},
    "fixtures": {"interface", "model"},
    "bench": {"", "interface", "model", "decoding", "session", "fixtures", "distributed"},
}


def _modules() -> dict[str, Path]:
    found = {}
    for prefix, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([prefix, *parts])] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The longest known module that `name` is or lies in (None: not ours)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            # `from pkg import name`: the submodule pkg.name when there is one, else pkg.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                       for alias in node.names]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            targets = [node.args[0].value]  # importlib.import_module("a.b"): an import all the same
        else:
            continue
        out.update(t for t in map(_resolve, targets) if t and t != module)
    return out


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
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


def _room(module: str) -> str | None:
    """The engine room of `module` ("" for the engine's top-level modules), None outside."""
    if module == ENGINE or not module.startswith(ENGINE + "."):
        return None
    parts = module[len(ENGINE) + 1:].split(".")
    if parts[0] == "interface":
        return "interface"
    return parts[0] if len(parts) > 1 or parts[0] in ALLOWED else ""


def test_the_graph_sees_the_known_edges():
    # Guards the checker itself: a lazy import and a from-import of a submodule are edges.
    assert "mtplxd.engine.model.hybrid" in GRAPH["mtplxd.engine.model.loader"]  # inside a function
    assert "mtplxd.engine.decoding.fused" in GRAPH["mtplxd.engine.bench.pieces"]  # from pkg import mod
    assert "mtplxd.engine.session.store" in GRAPH["mtplxd.engine.session.bank"]  # TYPE_CHECKING
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_among_our_modules():
    assert _cycles(GRAPH) == []


BLAS = "mtplxd.blas"
MATMUL_PRECISION = "mtplxd.matmul_precision"
# Stdlib-only leaves the engine imports before MLX loads (and reads again to report them).
ENGINE_LEAVES = (BLAS, MATMUL_PRECISION)


def test_the_blas_chooser_and_the_matmul_precision_are_leaves_the_engine_can_import_first():
    for leaf in ENGINE_LEAVES:
        assert not [t for t in GRAPH[leaf] if t.startswith("mtplxd")]


def test_each_engine_room_imports_only_the_rooms_below_it():
    wrong = []
    for module, targets in GRAPH.items():
        room = _room(module)
        if room is None:
            continue
        for target in targets:
            target_room = _room(target)
            if target == ENGINE:
                target_room = ""  # the package's public names: loaded_model and interface
            if target_room is not None and target_room != room and target_room not in ALLOWED[room]:
                wrong.append(f"{module} -> {target}")
            # mtplxd.blas and mtplxd.matmul_precision, stdlib-only leaves, set MLX up before it loads.
            if target_room is None and target.startswith("mtplxd") and target not in (ENGINE, *ENGINE_LEAVES):
                wrong.append(f"{module} -> {target} (the engine imports nothing else of mtplxd)")
    assert wrong == []


def test_the_runtime_path_reaches_no_benchmark_or_fixture_module_statically():
    roots = ["mtplxd.__main__", ENGINE, f"{ENGINE}.loaded_model", f"{ENGINE}.generation"]
    seen, todo = set(roots), list(roots)
    while todo:
        for target in GRAPH[todo.pop()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    assert sorted(m for m in seen if m.startswith(NOT_RUNTIME)) == []


def test_the_engine_imports_no_trio_or_http_code():
    # Statically: at run time a dependency (huggingface_hub's HTTP stack) may load trio itself.
    banned = ("trio", "quart", "quart_trio", "hypercorn", "httpx", "h11")
    wrong = []
    for module, path in MODULES.items():
        if module.startswith(ENGINE):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                         else [])
                wrong += [f"{module} -> {n}" for n in names if n.split(".")[0] in banned]
    assert wrong == []


def test_loading_and_generating_imports_no_benchmark_or_fixture_module(tiny_model_factory):
    path = tiny_model_factory("qwen3")
    script = f"""
import json, sys
from mtplxd.engine import GenerationRequest, SamplingParams, load_model
model = load_model({str(path)!r})
model.complete(GenerationRequest([1, 2, 3], SamplingParams(max_tokens=4)))
print(json.dumps(sorted(sys.modules)))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout.splitlines()[-1])
    assert [m for m in loaded if m.startswith(NOT_RUNTIME)] == []


def test_the_daemon_imports_no_benchmark_or_fixture_module():
    script = "import json, sys, mtplxd.__main__, mtplxd.daemon; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert [m for m in json.loads(done.stdout) if m.startswith(NOT_RUNTIME)] == []


def test_mtplxctl_starts_without_loading_mlx():
    """Every `mtplxctl` command builds the whole parser first: importing the engine there
    (MLX, mlx-lm, transformers) cost each command, `status` included, about a second."""
    script = ("import json, sys, mtplxctl.cli; mtplxctl.cli.build_parser(); "
              "print(json.dumps(sorted(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout)
    assert [m for m in loaded if m in ("mlx.core", "mlx_lm", "transformers") or m.startswith(ENGINE)] == []
