"""Every third-party package the library imports is declared in pyproject.toml (issue #41):
a package that only arrives through another one (scipy through great-expectations, paramiko
through the SSH provider ...) disappears the day that package stops needing it, and the
import breaks in production, not here. Held by reading the code's imports (AST, lazy ones
included) against the declared dependencies."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LIBRARY = REPO / "plugins" / "speedmatrix"


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> set[str]:
    """The distributions pyproject.toml's [project] dependencies name (not the dev group)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {
        _normalize(re.split(r"[\s<>=!~;\[]", dep, maxsplit=1)[0]) for dep in project["dependencies"]
    }


def imported(root: Path) -> dict[str, set[str]]:
    """Top-level absolute imports of every module under ``root``: name -> files importing it."""
    found: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(str(path.relative_to(root)))
    return found


def undeclared(imports: dict[str, set[str]], deps: set[str]) -> dict[str, str]:
    """Third-party imports no declared distribution provides: name -> why (files or unknown)."""
    providers = packages_distributions()
    missing: dict[str, str] = {}
    for name, files in sorted(imports.items()):
        if name in sys.stdlib_module_names or name == "speedmatrix":
            continue
        dists = {_normalize(d) for d in providers.get(name, [])}
        if not dists:
            missing[name] = f"no installed distribution provides it ({sorted(files)})"
        elif not dists & deps:
            missing[name] = f"provided by {sorted(dists)}, not declared ({sorted(files)})"
    return missing


def test_every_third_party_import_of_the_library_is_declared():
    assert undeclared(imported(LIBRARY), declared()) == {}


def test_an_undeclared_import_is_named(tmp_path):
    # the check itself can fail: a module importing scipy without scipy declared is named
    (tmp_path / "mod.py").write_text("def f():\n    from scipy import stats\n")
    got = undeclared(imported(tmp_path), declared() - {"scipy"})
    assert list(got) == ["scipy"]
    assert "mod.py" in got["scipy"]
