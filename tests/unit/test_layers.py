"""The import graph of torchring/: every module imports only from layers below its own (so
there is no cycle), and an import inside a function carries a comment saying why."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "torchring"

# Lowest first: a folder (or a top-level module) may import from lower layers only; the
# modules inside one folder may import each other, never in a circle. A new module belongs in
# a folder of this table (or, for a public entry point, beside them).
LAYERS = [
    {"trace"},                             # the flight recorder's dumps and their diagnosis
    {"_core"},                             # settings, env, errors, log, types, build, context, ...
    {"cuda", "build", "c10d"},             # public entry points on the core
    {"collectives", "launch"},             # the collectives API and groups; the launcher
    {"_wrap"},                             # wrap: model, reducer, buckets, join, memory
    {"data", "memory"},                    # torchring.data; torchring.memory (public names)
    {"elastic"},                           # torchring.elastic: membership epochs, re-forming, State
    {"horovod", "run"},                    # torchring.horovod; python -m torchring.run
]

# Folders whose modules may import each other (never in a circle).
PACKAGES = ("trace", "_core", "collectives", "_wrap", "launch", "data", "elastic", "horovod")


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        if "csrc" in path.parts:
            continue
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        found[".".join(p for p in parts if p != "__init__")] = path  # "" is the package itself
    return found


def _layer(module: str) -> int:
    top = module.split(".")[0]
    return next(i for i, layer in enumerate(LAYERS) if top in layer)


def _imports(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, ast.stmt]]:
    """(torchring module imported, the import statement) for every import of `path`."""
    package = module.split(".")[:-1] if path.name != "__init__.py" else module.split(".")
    package = [p for p in package if p]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").startswith("torchring"):
                source = node.module.removeprefix("torchring").lstrip(".")
            else:
                out.append(("", node))  # outside torchring: only the local-import rule applies
                continue
            for alias in node.names:
                name = f"{source}.{alias.name}".lstrip(".")
                out.append((name if name in modules else source, node))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                name = alias.name.removeprefix("torchring").lstrip(".")
                out.append((name if alias.name.startswith("torchring") else "", node))
    return out


def test_every_module_has_a_layer() -> None:
    missing = [m for m in _modules() if m and not any(m.split(".")[0] in layer for layer in LAYERS)]
    assert not missing, f"put {missing} in LAYERS"


def test_modules_import_only_from_lower_layers() -> None:
    modules = _modules()
    wrong = []
    for module, path in modules.items():
        if not module:
            continue  # the package's __init__ re-exports everything
        for imported, node in _imports(module, path, modules):
            if not imported or imported == module:
                continue
            same_package = module.split(".")[0] == imported.split(".")[0] in PACKAGES
            if _layer(imported) > _layer(module) or (_layer(imported) == _layer(module) and not same_package):
                wrong.append(f"{module} (line {node.lineno}) imports {imported}")
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_package_modules_do_not_import_each_other_in_a_circle() -> None:
    modules = _modules()
    edges = {m: {i for i, _ in _imports(m, p, modules)
                 if i.split(".")[0] == m.split(".")[0] and i != m and "." in i}
             for m, p in modules.items() if m.split(".")[0] in PACKAGES}
    done: set[str] = set()

    def visit(m: str, stack: list[str]) -> None:
        assert m not in stack, f"import circle: {' -> '.join(stack + [m])}"
        if m not in done:
            for n in edges.get(m, ()):
                visit(n, stack + [m])
            done.add(m)

    for m in edges:
        visit(m, [])


def test_imports_inside_functions_say_why() -> None:
    unexplained = []
    for module, path in _modules().items():
        lines = path.read_text().splitlines()
        for func in ast.walk(ast.parse(path.read_text())):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    around = lines[max(0, node.lineno - 3):node.lineno]
                    if not any("#" in line for line in around):
                        unexplained.append(f"torchring/{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not unexplained, f"function-local imports without a comment: {unexplained}"
