"""The two maps of the code a newcomer reads, docs/layout.md's tree and docs/design.md's Layout
list, name every module of the library and nothing that is not there: a module added, moved
or removed without its line fails here, so the maps cannot drift from the code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIB = ROOT / "plugins" / "speedmatrix"


def _modules() -> dict[str, set[str]]:
    """Package ('' for the top) -> its module and subpackage names (no __init__/__main__)."""
    out: dict[str, set[str]] = {}
    for path in LIB.rglob("*.py"):
        rel = path.relative_to(LIB)
        if path.stem.startswith("__") or "__pycache__" in rel.parts:
            continue
        package = rel.parts[0] if len(rel.parts) > 1 else ""
        name = rel.parts[1] if len(rel.parts) > 2 else path.stem
        out.setdefault(package, set()).add(name.removesuffix(".py"))
    return out


def _block(doc: Path, heading: str) -> str:
    text = doc.read_text(encoding="utf-8")
    section = text.split(heading, 1)[1]
    return re.search(r"```\n(.*?)```", section, flags=re.S).group(1)


def _tree_entries(block: str) -> dict[str, str]:
    """docs/layout.md's tree: each top entry (`store/`, `records.py`) with the text it owns
    (its line and the indented lines under it)."""
    entries: dict[str, str] = {}
    current = None
    for line in block.splitlines():
        match = re.match(r"^  (\S+)", line)
        if match:
            current = match.group(1)
            entries[current] = line
        elif current and line.startswith("   "):
            entries[current] += "\n" + line
        else:
            current = None
    return entries


def _words(text: str) -> set[str]:
    return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))


def layout_problems(block: str, modules: dict[str, set[str]]) -> list[str]:
    entries = _tree_entries(block)
    problems = []
    for name in sorted(modules.get("", set())):
        if f"{name}.py" not in entries:
            problems.append(f"{name}.py is not in the tree")
    for entry in entries:
        if entry.endswith(".py") and entry.removesuffix(".py") not in modules.get("", set()):
            problems.append(f"{entry} is in the tree but not in the code")
    for package, names in sorted(modules.items()):
        if not package:
            continue
        text = entries.get(f"{package}/")
        if text is None:
            problems.append(f"{package}/ is not in the tree")
            continue
        words = _words(text)
        problems += [f"{package}/{n} is not named in the tree" for n in sorted(names - words)]
        named = set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\.py\b", text))
        problems += [f"{package}/{n}.py is in the tree, not in the code" for n in named - names]
    return problems


def design_problems(block: str, modules: dict[str, set[str]]) -> list[str]:
    """docs/design.md's Layout list names every module in its package's rows (a package's
    rows are those from the line that names `package/` to the next package's)."""
    words = _words(block)
    problems = []
    for package, names in sorted(modules.items()):
        if package and f"{package}/" not in block:
            problems.append(f"{package}/ is not in design.md's Layout")
        problems += [
            f"{package + '/' if package else ''}{n} is not in design.md's Layout"
            for n in sorted(names - words)
        ]
    return problems


def test_layout_md_tree_names_every_module_and_only_those():
    block = _block(ROOT / "docs" / "layout.md", "## What is where")
    assert layout_problems(block, _modules()) == []


def test_design_md_layout_names_every_module():
    block = _block(ROOT / "docs" / "design.md", "## Layout")
    assert design_problems(block, _modules()) == []


@pytest.mark.parametrize("checker", [layout_problems, design_problems])
def test_a_module_missing_from_a_map_is_found(checker):
    """The checks can fail: a module the maps do not name, and a named one that is gone."""
    block = "```\n  records.py  the contract\n  store/  delta.py, query\n```"
    block = block.strip("`\n")
    modules = {"": {"records"}, "store": {"delta", "query", "migrate"}}
    problems = checker(block, modules)
    assert any("migrate" in p for p in problems), problems
    if checker is layout_problems:
        gone = layout_problems("  records.py x\n  old.py y\n  store/ delta query migrate", modules)
        assert gone == ["old.py is in the tree but not in the code"]
