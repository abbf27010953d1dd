"""Imports flow one way: capture -> payload <- collate <- loaders, models and objectives may import
collate, the orchestrator (downstream of both sides) may import capture, collate and loaders;
the two leaves rollfeed.errors and rollfeed.deprecation (renamed names kept for a release) may be
imported by anyone; payload loads nothing of ours and never vLLM."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import rollfeed
import rollfeed.capture
import rollfeed.collate
import rollfeed.payload

LIBRARY = Path(rollfeed.__file__).resolve().parent

# Leaf modules every package may import: they import nothing of ours.
LEAVES = ("errors", "deprecation")
# The packages of ours each library package may import, besides itself and the leaves.
ALLOWED = {
    "__init__": set(),  # ``import rollfeed.payload`` runs it: it must load nothing else
    "errors": set(),
    "deprecation": set(),
    "payload": set(),
    "capture": {"payload"},
    "collate": {"payload"},
    "loaders": {"collate", "payload"},
    "models": {"collate"},
    # Loss objectives over the scorer's results: they read collate's types (ragged rows, the
    # micro batch's sample boundaries), never the scorer itself.
    "objectives": {"collate"},
    # Between the capture server and the trainer: it makes collate's samples and loaders' step
    # files from capture's answers.
    "orchestrator": {"capture", "payload", "collate", "loaders"},
}
# Entry points and applications: they may import any package, and no library package imports them.
APPS = {"__main__", "cli", "demo", "bench"}
# The only library package that may import vLLM (lazily: it is an optional extra).
VLLM_USERS = {"capture"}


def _imported(tree: ast.AST, package: tuple[str, ...]) -> list[tuple[str, int]]:
    """``(dotted module, line)`` of every import in ``tree``, relative ones resolved."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            if module == "rollfeed":  # ``from rollfeed import payload``: the names are modules
                out += [(f"rollfeed.{alias.name}", node.lineno) for alias in node.names]
            else:
                out.append((module, node.lineno))
    return out


def _violations(library: Path) -> list[str]:
    """Every import under ``library`` (a ``rollfeed`` tree) against the flow, as readable lines."""
    found = []
    for path in sorted(library.rglob("*.py")):
        rel = path.relative_to(library).with_suffix("").parts
        top, package = rel[0], ("rollfeed", *rel[:-1])  # package: what ``from .`` names
        if top in APPS:
            continue
        if top not in ALLOWED:
            found.append(f"{path}: package {top!r} is not placed in the import flow")
            continue
        for module, line in _imported(ast.parse(path.read_text(), str(path)), package):
            parts = module.split(".")
            if parts[0] == "vllm" and top not in VLLM_USERS:
                found.append(f"{path}:{line}: {top} imports vllm")
            if parts[0] != "rollfeed" or len(parts) < 2:
                continue
            target = parts[1]
            if target == top or target in LEAVES:
                continue
            if target in APPS or target not in ALLOWED[top]:
                found.append(f"{path}:{line}: {top} imports {module} (may import {ALLOWED[top]})")
    return found


def test_every_import_of_the_library_follows_the_flow():
    assert _violations(LIBRARY) == []


def test_a_backwards_import_is_found(tmp_path):
    lib = tmp_path / "rollfeed"
    for name, text in {
        "__init__.py": "",
        "errors.py": "",
        "payload/__init__.py": "from rollfeed.errors import RollfeedError\n",
        "payload/reader.py": "def f():\n    from rollfeed.capture import kept_set\n",
        "payload/engine.py": "import vllm\n",
        "capture/__init__.py": "from rollfeed.payload import PayloadWriter\nimport vllm\n",
        "collate/plan.py": "from .. import loaders\n",
        "models/score.py": "from rollfeed.collate import Sample\nfrom rollfeed.demo import run\n",
        "demo/run.py": "from rollfeed import capture, collate, loaders, models, payload\n",
        "serve/app.py": "",
    }.items():
        (lib / name).parent.mkdir(parents=True, exist_ok=True)
        (lib / name).write_text(text)
    found = _violations(lib)
    assert len(found) == 5, found
    assert any("reader.py:2: payload imports rollfeed.capture" in f for f in found)
    assert any("engine.py:1: payload imports vllm" in f for f in found)
    assert any("plan.py:1: collate imports rollfeed.loaders" in f for f in found)
    assert any("score.py:2: models imports rollfeed.demo" in f for f in found)
    assert any("package 'serve' is not placed" in f for f in found)


def test_importing_payload_loads_nothing_of_capture_and_no_vllm():
    code = "import json, sys; import rollfeed.payload; print(json.dumps(sorted(sys.modules)))"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    loaded = json.loads(proc.stdout.splitlines()[-1])
    ours = {m for m in loaded if m.split(".")[0] == "rollfeed"}
    assert "rollfeed.payload.read.reader" in ours  # the check sees payload's own modules
    assert {m for m in ours if m.split(".")[:2] != ["rollfeed", "payload"]} <= {
        "rollfeed",
        "rollfeed.errors",
    }
    assert not [m for m in loaded if m.split(".")[0] == "vllm"]


def test_payload_and_collate_export_nothing_of_capture():
    capture = set(rollfeed.capture.__all__)
    assert not capture & set(rollfeed.payload.__all__)
    assert not capture & set(rollfeed.collate.__all__)
    assert not [n for n in capture if hasattr(rollfeed.payload, n) or hasattr(rollfeed.collate, n)]


def test_loaders_import_only_the_public_face_of_other_packages():
    """The loaders reach payload and collate through their packages' public names (``from
    rollfeed.payload import ...``), never a module inside them: what those packages keep private
    can change without the loaders noticing."""
    found = []
    for path in sorted((LIBRARY / "loaders").rglob("*.py")):
        for module, line in _imported(ast.parse(path.read_text()), ("rollfeed", "loaders")):
            parts = module.split(".")
            if parts[0] == "rollfeed" and len(parts) > 2 and parts[1] != "loaders":
                found.append(f"{path.name}:{line}: {module}")
    assert found == []
