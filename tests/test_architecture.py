"""The import contract of ARCHITECTURE.md, checked on the source: each part of `src/sparsecnn` imports
only the parts listed for it (function-level imports included), a backend folder never imports another
backend, and every backend folder has its registration, its op and its mirrored test file."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "sparsecnn"
BACKEND_FOLDERS = sorted(p.name for p in (PACKAGE / "backends").iterdir()
                         if p.is_dir() and (p / "__init__.py").exists())

_LOW = {"core", "settings"}
ALLOWED = {
    "settings": set(),
    "core": {"settings"},
    "models": set(),
    "data": set(),
    "backend": _LOW,  # any backends/<name>/: core and settings only, never another backend
    "backends": _LOW | {f"backends.{name}" for name in BACKEND_FOLDERS},
    "prune": _LOW | {"models", "data", "backends.blocks"},  # OptPrune re-pruning uses Algorithm 1's blocks
    "nn": _LOW | {"backends"},
    "passes": _LOW | {"nn", "prune"},
    "tuning": _LOW | {"backends", "nn", "passes"},
    "layers": _LOW | {"models"},
    "bench": _LOW | {"backends", "models", "nn", "passes", "prune", "tuning", "layers"},
    "artifact": _LOW | {"sparsecnn", "backends", "models", "nn", "passes", "prune", "tuning"},
    "demo": _LOW | {"bench", "models", "nn", "passes", "prune", "tuning"},
    "cli": _LOW | {"artifact", "backends", "bench", "data", "demo", "doctor", "layers", "models", "prune", "tuning"},
    "doctor": _LOW | {"artifact", "backends", "bench", "data", "demo", "layers", "models", "prune", "tuning"},
    "__init__": _LOW | {"artifact", "layers", "nn", "passes", "tuning"},  # artifact: on first use
}


def _part(parts):
    """The contract's name for module `parts` (a path under sparsecnn, without .py)."""
    if parts[0] == "backends" and len(parts) > 2:
        return f"backends.{parts[1]}"
    return parts[0]


def _imported_parts(path: Path, package: Path):
    """(line, part) for each sparsecnn import in the file at `path`."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module == "sparsecnn":
            names = [f"sparsecnn.{alias.name}" if (package / alias.name).is_dir() else "sparsecnn"
                     for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "sparsecnn":
                yield node.lineno, ("sparsecnn" if len(parts) == 1 else _part(parts[1:] + ["x"]))


def _violations(package=PACKAGE):
    found = []
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package).with_suffix("").parts)
        own = _part(parts)
        rule = "backend" if own.startswith("backends.") else own
        allowed = ALLOWED[rule] | {own}
        for line, part in _imported_parts(path, package):
            if part not in allowed and not (rule == "nn" and part.startswith("backends")) \
                    and not (part.startswith("backends.") and "backends" in allowed and rule != "backend"):
                found.append(f"{path.relative_to(package.parent)}:{line} ({own}) imports {part}")
    return found


def test_every_part_imports_only_what_the_contract_allows():
    assert _violations() == []


def test_the_contract_catches_an_upward_import(tmp_path):
    fake = tmp_path / "sparsecnn"
    (fake / "core").mkdir(parents=True)
    (fake / "backends" / "x").mkdir(parents=True)
    (fake / "backends" / "x" / "__init__.py").write_text("")
    (fake / "core" / "spec.py").write_text("from sparsecnn.tuning import sparsify_\n")
    (fake / "backends" / "x" / "kernel.py").write_text("from sparsecnn.backends.direct import format\n")
    assert sorted(_violations(fake)) == ["sparsecnn/backends/x/kernel.py:1 (backends.x) imports backends.direct",
                                     "sparsecnn/core/spec.py:1 (core) imports tuning"]


@pytest.mark.parametrize("name", BACKEND_FOLDERS)
def test_every_backend_folder_registers_has_an_op_and_a_mirrored_test_file(name):
    folder = PACKAGE / "backends" / name
    registration = (folder / "backend.py").read_text()
    assert "register_backend(" in registration or "register_triton_backend(" in registration
    assert "custom_op(" in (folder / "op.py").read_text()
    assert (ROOT / "tests" / "backends" / f"test_{name}.py").exists()
    assert f"backends.{name} import backend" in (PACKAGE / "backends" / "__init__.py").read_text()


def _module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(path: Path, package: Path, modules: set) -> set:
    """The sparsecnn modules the file at `path` imports when it is imported (module-level statements;
    `from a import b` counts a.b where that is a module, else a)."""
    found = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules:
            found.update(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                         for alias in node.names)
    return found


def _import_cycles(package=PACKAGE):
    """Groups of modules that import each other at import time (strongly connected components of
    more than one module), each sorted."""
    paths = {_module_name(path, package): path for path in package.rglob("*.py")}
    graph = {name: _top_level_imports(path, package, set(paths)) for name, path in paths.items()}
    order, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(name):
        order[name] = low[name] = len(order)
        stack.append(name)
        on_stack.add(name)
        for target in graph[name]:
            if target not in order:
                visit(target)
                low[name] = min(low[name], low[target])
            elif target in on_stack:
                low[name] = min(low[name], order[target])
        if low[name] == order[name]:
            group = []
            while not group or group[-1] != name:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                cycles.append(sorted(group))

    for name in sorted(graph):
        if name not in order:
            visit(name)
    return cycles


def test_no_module_imports_itself_back_at_import_time():
    assert _import_cycles() == []


def test_the_cycle_check_catches_a_package_importing_its_importer(tmp_path):
    fake = tmp_path / "sparsecnn"
    (fake / "tuning").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "tuning" / "__init__.py").write_text("from sparsecnn.tuning.sparsify import sparsify_\n")
    (fake / "tuning" / "select.py").write_text("Timer = object\n")
    (fake / "tuning" / "sparsify.py").write_text("from sparsecnn.tuning import Timer\n")
    assert _import_cycles(fake) == [["sparsecnn.tuning", "sparsecnn.tuning.sparsify"]]
    (fake / "tuning" / "sparsify.py").write_text("from sparsecnn.tuning.select import Timer\n")
    assert _import_cycles(fake) == []
