"""The package's three layers import only downward: the engine (``_engine``) nothing of
Celery, kombu or the other layers; the Celery integration (``_celery``) nothing of the
tooling (``_tools``). Read from each module's imports, top level and inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "celery_ratelimit"
#: What each layer may not import: other layers' subpackages, and outside libraries.
FORBIDDEN = {
    "_engine": ("celery_ratelimit._celery", "celery_ratelimit._tools", "celery", "kombu"),
    "_celery": ("celery_ratelimit._tools",),
}


def parse(source: str) -> ast.Module:
    """``ast.parse``, again once if CPython 3.11 before 3.11.8 raised its "AST
    constructor recursion depth mismatch" (cpython#106905: a thread of an earlier test
    that changes the recursion limit meanwhile shifts every thread's depth count)."""
    try:
        return ast.parse(source)
    except SystemError:
        return ast.parse(source)


def imports_of(path: Path) -> set[str]:
    """The absolute module names ``path`` imports (relative imports resolved)."""
    module = "celery_ratelimit." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
    package = module.rpartition(".")[0]
    found = set()
    for node in ast.walk(parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                head = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{head}.{base}" if base else head
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_a_layer_imports_only_the_layers_below_it(layer: str) -> None:
    modules = sorted((PACKAGE / layer).glob("*.py"))
    assert modules
    crossing = {
        f"{path.name} imports {name}"
        for path in modules
        for name in imports_of(path)
        if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[layer])
    }
    assert not crossing, sorted(crossing)


def test_every_module_is_in_a_layer() -> None:
    loose = {p.name for p in PACKAGE.glob("*.py")} - {"__init__.py", "__main__.py"}
    assert not loose, f"modules outside the three layers: {sorted(loose)}"
