"""The import graph of the package, read statically: no circles between files, and no
production module imports `pipekit.testing` (tests build on `pipekit.spawn`, not the
other way round). Every import counts, also one inside a function or under
TYPE_CHECKING: a deferred import still ties two files together."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pipekit"


def _module_file(dotted: str) -> Path | None:
    """The file of a `pipekit...` module: `a/b.py`, or the package's `a/b/__init__.py`."""
    parts = dotted.split(".")[1:]
    base = PACKAGE.joinpath(*parts)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _imports(path: Path) -> set[Path]:
    """The pipekit files `path` imports (`from . import x` counts as the submodule x where one exists)."""
    package = ".".join(("pipekit", *path.relative_to(PACKAGE).with_suffix("").parts))
    if path.name == "__init__.py":
        package = package.removesuffix(".__init__")
    else:
        package = package.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("pipekit")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            if not base.startswith("pipekit"):
                continue
            names = [f"{base}.{a.name}" for a in node.names if _module_file(f"{base}.{a.name}")] or [base]
        else:
            continue
        found |= {f for f in map(_module_file, names) if f is not None and f != path}
    return found


def _graph() -> dict[Path, set[Path]]:
    return {path: _imports(path) for path in PACKAGE.rglob("*.py")}


def _cycle(graph: dict[Path, set[Path]]) -> list[Path] | None:
    """One import circle (its files, in order), or None."""
    state: dict[Path, int] = {}
    stack: list[Path] = []

    def visit(node: Path) -> list[Path] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_package_has_no_import_circles():
    circle = _cycle(_graph())
    assert circle is None, "import circle: " + " -> ".join(str(p.relative_to(PACKAGE)) for p in circle)


def test_production_code_does_not_import_the_test_helpers():
    testing = PACKAGE / "testing.py"
    users = sorted(str(p.relative_to(PACKAGE)) for p, deps in _graph().items() if testing in deps)
    assert users == [], f"production modules importing pipekit.testing: {users}"


def test_the_reader_sees_a_circle_and_a_relative_import():
    """The checks above are only as good as the graph: it holds the edges it must."""
    graph = _graph()
    assert PACKAGE / "schedules" / "validate.py" in graph[PACKAGE / "schedules" / "program.py"]
    assert PACKAGE / "spawn.py" in graph[PACKAGE / "testing.py"]
    assert PACKAGE / "auxloss.py" in graph[PACKAGE / "run" / "loop.py"]  # `from .. import auxloss`
    assert PACKAGE / "run" / "launch.py" in graph[PACKAGE / "run" / "start.py"]  # `from . import launch`
    assert _cycle({Path("a"): {Path("b")}, Path("b"): {Path("a")}}) == [Path("a"), Path("b"), Path("a")]
