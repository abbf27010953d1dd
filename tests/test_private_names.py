"""The library uses public torch / torchdata APIs only: no private name imported or reached.

Private means a dotted component that starts with ``_`` and is not a dunder (``torch._utils``,
``torch.utils.data._utils``, ``from torch import _C``, ``DataLoader._iterator`` reached from an
imported torch name). Checked on the AST of every module under ``rollfeed/`` (tests may poke at
internals; the library may not): a private torch name breaks with any torch release.
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
