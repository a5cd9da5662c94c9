"""The model math stays below the runtime (README, "Layout": model math never imports the
runtime): no file under pipekit/models/ or pipekit/layers/ imports the engine, the pipeline, checkpoints, the
training loop, the command line, file interchange or the other runtime modules, at
load time or inside a function. Read from the source (ast), so nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MATH = sorted([*(ROOT / "pipekit" / "models").rglob("*.py"), *(ROOT / "pipekit" / "layers").rglob("*.py")])
# modules of the pipekit package that model math must not import
RUNTIME = {"engine", "pipeline", "checkpoint", "run", "plan", "cli", "interchange", "data", "testing"}


def pipekit_modules(source: str, path: Path) -> list[str]:
    """Every pipekit module that `source`, standing at `path`, imports anywhere (dotted, from `pipekit`)."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]  # e.g. ("pipekit", "models")
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "pipekit"]
        elif isinstance(node, ast.ImportFrom) and node.level:
            base = ".".join(package[: len(package) - node.level + 1])
            found += [f"{base}.{node.module}" if node.module else f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "pipekit":
            found.append(node.module)
    return found


def test_the_reader_resolves_relative_and_function_level_imports():
    source = "from ..checkpoint import META\nfrom . import hf\ndef f():\n    import pipekit.run.loop\n"
    found = pipekit_modules(source, ROOT / "pipekit" / "models" / "x.py")
    assert sorted(found) == ["pipekit.checkpoint", "pipekit.models.hf", "pipekit.run.loop"]


def test_the_model_math_files_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in MATH}
    assert {"pipekit/models/hf.py", "pipekit/models/gpt2.py", "pipekit/layers/block.py"} <= names


@pytest.mark.parametrize("path", MATH, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_model_math_imports_no_runtime(path):
    runtime = [m for m in pipekit_modules(path.read_text(), path) if m.split(".")[1] in RUNTIME]
    assert not runtime, f"{path.relative_to(ROOT)} imports {runtime}: model math stays below the runtime"


LIBRARY = sorted(p for p in (ROOT / "pipekit").rglob("*.py")
                 if p.relative_to(ROOT / "pipekit").parts[0] not in ("run", "plan", "cli.py"))


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_library_never_imports_the_application(path):
    app = [m for m in pipekit_modules(path.read_text(), path) if len(m.split(".")) > 1
           and m.split(".")[1] in ("run", "plan", "cli")]
    assert not app, f"{path.relative_to(ROOT)} imports {app}: the application (run/, plan/, cli) sits on the library"


def test_plan_does_not_import_run():
    for path in (ROOT / "pipekit" / "plan").glob("*.py"):
        run = [m for m in pipekit_modules(path.read_text(), path) if m.startswith("pipekit.run")]
        assert not run, f"{path.relative_to(ROOT)} imports {run}: `pipekit train` uses the plan, not the reverse"


def test_the_flat_package_stays_small():
    flat = sorted(p.name for p in (ROOT / "pipekit").glob("*.py") if p.name != "__init__.py")
    assert len(flat) <= 20, f"{len(flat)} flat modules under pipekit/ (at most 20): {flat}"


def test_moved_modules_keep_their_old_names():
    import importlib

    import pipekit

    for old, new in pipekit.MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
