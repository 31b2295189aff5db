"""The Warehouse protocols (speedmatrix.store.protocol) say what the store's warehouse is: every
member they name is the concrete class's, with the same parameters, so an annotation with them
never promises what the object handed in does not do. A type checker is not part of the
suite; this holds the part of its check that can drift (the concrete class changing)."""

from __future__ import annotations

import inspect

import pytest

from speedmatrix.store import protocol
from speedmatrix.store.warehouse import Warehouse as DeltaWarehouse


def _members(proto: type) -> dict[str, object]:
    """A protocol's own members (its methods and its annotated attributes), with its bases'."""
    out: dict[str, object] = {}
    for klass in reversed(proto.__mro__):
        if klass in (object,) or not getattr(klass, "_is_protocol", False):
            continue
        out.update({n: None for n in getattr(klass, "__annotations__", {})})
        out.update({n: v for n, v in vars(klass).items() if inspect.isfunction(v) and n[0] != "_"})
    return out


def _parameters(func: object) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(func).parameters.values()]


@pytest.mark.parametrize("proto", [protocol.WarehouseReader, protocol.Warehouse])
def test_the_concrete_warehouse_has_every_member_with_the_same_parameters(proto, tmp_path):
    wh = DeltaWarehouse(tmp_path / "wh")
    try:
        members = _members(proto)
        assert members, proto
        for name, method in members.items():
            assert hasattr(wh, name), f"Warehouse has no {name}"
            if method is not None:
                concrete = getattr(DeltaWarehouse, name)
                assert _parameters(method) == _parameters(concrete), name
    finally:
        wh.close()


def test_the_writer_is_a_reader_and_more():
    reader, writer = _members(protocol.WarehouseReader), _members(protocol.Warehouse)
    assert set(reader) < set(writer)
    assert {"root", "read_run", "query", "read_artifact"} <= set(reader)
    assert {"write_artifact", "quarantine", "land_table"} <= set(writer) - set(reader)


def test_no_signature_takes_a_warehouse_of_any_type():
    """Every function handed a warehouse says which protocol it uses, but in the files
    another change is rewriting (LEFT_ANY)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    found = [
        f"{p.relative_to(root)}:{n}"
        for top in ("plugins", "dags")
        for p in sorted((root / top).rglob("*.py"))
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if re.search(r"\b(warehouse|wh): Any\b", line)
    ]
    assert found == [], found
