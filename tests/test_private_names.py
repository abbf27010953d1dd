"""The library uses public torch / torchdata APIs only: no private name imported or reached.

Private means a dotted component that starts with ``_`` and is not a dunder (``torch._utils``,
``torch.utils.data._utils``, ``from torch import _C``, ``DataLoader._iterator`` reached from an
imported torch name). Checked on the AST of every module under ``rollfeed/`` (tests may poke at
internals; the library may not): a private torch name breaks with any torch release. An object's
private attribute is caught too when the library does not define that name itself
(``mesh._flatten``, ``obj._pg_registry`` on a ``DeviceMesh``), whatever the object is.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

LIBRARY = Path(__file__).resolve().parents[1] / "rollfeed"
WATCHED = ("torch", "torchdata")


def _private(dotted: str) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in dotted.split("."))


def _watched(module: str) -> bool:
    return module.split(".")[0] in WATCHED


def private_uses(source: str) -> list[str]:
    """``"line: name"`` for each private torch/torchdata name ``source`` imports or reaches."""
    tree = ast.parse(source)
    bound: dict[str, str] = {}  # local name -> the torch/torchdata name it stands for
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _watched(alias.name):
                    local = alias.asname or alias.name.split(".")[0]
                    bound[local] = alias.name if alias.asname else local
                    if _private(alias.name):
                        found.append(f"{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and _watched(node.module):
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                bound[alias.asname or alias.name] = name
                if _private(name):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            parts, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                parts.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in bound:
                name = ".".join([bound[base.id], *reversed(parts)])
                if _private(name) and not _private(bound[base.id]):
                    found.append(f"{node.lineno}: {name}")
    return sorted(set(found))


CASES = [
    ("from torch._utils import ExceptionWrapper", ["1: from torch._utils import ExceptionWrapper"]),
    ("from torch import _C", ["1: from torch import _C"]),
    ("import torch.distributed._tensor as dt", ["1: import torch.distributed._tensor"]),
    ("import torch\nx = torch._C._foo", ["2: torch._C", "2: torch._C._foo"]),
    (
        "from torch.utils.data import DataLoader\nDataLoader._iterator",
        ["2: torch.utils.data.DataLoader._iterator"],
    ),
    ("import torchdata.nodes as n\nn._x", ["2: torchdata.nodes._x"]),
    ("import torch\ntorch.Tensor.__len__, torch.cuda.is_available()", []),
    ("import numpy as np\nnp._x", []),
]


@pytest.mark.parametrize(("source", "expected"), CASES)
def test_the_check_finds_private_names(source, expected):
    assert private_uses(source) == expected


def test_library_uses_no_private_torch_or_torchdata_name():
    found = {
        str(path.relative_to(LIBRARY.parent)): uses
        for path in sorted(LIBRARY.rglob("*.py"))
        if (uses := private_uses(path.read_text()))
    }
    assert not found, f"private torch/torchdata names used by the library: {found}"


# Private by name, public by documentation: the standard library's exit without teardown.
DOCUMENTED = {"os._exit"}


def foreign_private_attributes(sources: dict[str, str]) -> list[str]:
    """``"file:line: expr"`` for each ``x._name`` whose ``_name`` none of ``sources`` defines
    (as a function, class, argument, import, or a name or attribute assigned)."""
    trees = {name: ast.parse(text) for name, text in sources.items()}
    defined = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                defined.add(node.name)
            elif isinstance(node, ast.Attribute | ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.attr if isinstance(node, ast.Attribute) else node.id)
            elif isinstance(node, ast.alias):
                defined.add(node.asname or node.name.split(".")[-1])
            elif isinstance(node, ast.arg):
                defined.add(node.arg)
    found = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and _private(node.attr)
                and node.attr not in defined
                and ast.unparse(node) not in DOCUMENTED
            ):
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    return sorted(found)


def test_the_attribute_check_finds_another_librarys_private_state():
    source = "class Mine:\n    _own = 1\ndef f(m, mesh):\n    m._own, mesh._pg_registry, os._exit"
    assert foreign_private_attributes({"m.py": source}) == ["m.py:4: mesh._pg_registry"]


def test_library_reaches_no_private_attribute_it_does_not_define():
    sources = {
        str(path.relative_to(LIBRARY.parent)): path.read_text()
        for path in sorted(LIBRARY.rglob("*.py"))
    }
    found = foreign_private_attributes(sources)
    assert not found, f"private attributes of other libraries' objects: {found}"
