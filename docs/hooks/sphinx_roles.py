"""A griffe extension: the API reference shows each public name once, where users import it, and
the docstrings' Sphinx roles become cross-references the docs site checks.

- Public names: a name a package exports (``rollfeed.payload.PayloadRoot``, in its ``__all__``)
  is documented there, and no more in the module that defines it
  (``rollfeed.payload.root``), which the reference shows with its other names.
- Roles: rollfeed's docstrings name other objects the Sphinx way
  (``:class:`~rollfeed.collate.RaggedRows```, ``:func:`support_logprobs```); mkdocstrings renders
  Markdown, where such a role is text. Every role becomes an autoref
  (``[`RaggedRows`][rollfeed.payload.RaggedRows]``): a dotted ``rollfeed.`` name as written, a
  short one resolved in the docstring's own scope (its module's imports and members), each sent to
  the public name when it has one. Another library's name (``torch.Tensor``) and a private one
  (``_helper``) stay code. A name that resolves to nothing stays a reference, so
  ``mkdocs build --strict`` fails on it, naming it.
- A reST literal-block marker (``Example::``) becomes a colon.

Example: in ``rollfeed.models.support``, ``:class:`TemperatureError``` becomes
``[`TemperatureError`][rollfeed.models.TemperatureError]``.
"""

from __future__ import annotations

import importlib.util
import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|func|mod|meth|attr|data|exc|obj):`(~?)([^`<]+?)(?:\s*<([^>]+)>)?`")
LITERAL = re.compile(r"(\S)::$", re.MULTILINE)


def _walk(obj: griffe.Object) -> list[griffe.Object]:
    """``obj`` and every object defined under it (aliases left out)."""
    out, todo = [], [obj]
    while todo:
        one = todo.pop()
        out.append(one)
        todo += [m for m in one.members.values() if not m.is_alias]
    return out


def _public_names(pkg: griffe.Module) -> dict[str, str]:
    """canonical path -> the public path a package exports it as (its own package's first)."""
    public: dict[str, str] = {}
    for module in _walk(pkg):
        if not module.is_module or not module.exports:
            continue
        for name in module.exports:
            member = module.members.get(name)
            if member is None or not member.is_alias:
                continue
            path = f"{module.path}.{name}"
            target = member.target_path
            if target not in public or target.startswith(module.path + "."):
                public[target] = path
    return public


def _publish(path: str, public: dict[str, str]) -> str:
    """``path``, or the public path of the longest exported prefix of it."""
    parts = path.split(".")
    for cut in range(len(parts), 1, -1):
        head = ".".join(parts[:cut])
        if head in public:
            return ".".join([public[head], *parts[cut:]])
    return path


def _target(obj: griffe.Object, name: str) -> str | None:
    """The full path ``name`` stands for in ``obj``'s scope; None for another library's name."""
    name = name.lstrip(".")
    if name.startswith("rollfeed."):
        return name
    head, _, rest = name.partition(".")
    scope = obj if obj.is_module or obj.is_class else obj.parent
    try:
        found = scope.resolve(head)
    except griffe.NameResolutionError:
        if importlib.util.find_spec(head) is not None:
            return None  # a module of another library (multiprocessing.resource_sharer)
        return name  # left for autorefs to refuse, naming it
    if not found.startswith("rollfeed"):
        return None
    return f"{found}.{rest}" if rest else found


def _rewrite(obj: griffe.Object, text: str, public: dict[str, str]) -> str:
    def role(match: re.Match[str]) -> str:
        short, name, explicit = match.group(1), match.group(2).strip(), match.group(3)
        target = (explicit or name).strip()
        shown = name if explicit else (target.rsplit(".", 1)[-1] if short else target.lstrip("."))
        path = _target(obj, target)
        if path is None or any(part.startswith("_") for part in path.split(".")):
            return f"`{shown}`"  # another library's name, or a private one the site leaves out
        return f"[`{shown}`][{_publish(path, public)}]"

    return LITERAL.sub(r"\1:", ROLE.sub(role, text))


class SphinxRoles(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        public = _public_names(pkg)
        for obj in _walk(pkg):
            if obj.path in public:
                obj.public = False  # documented under its public name only
            if obj.docstring is not None:
                obj.docstring.value = _rewrite(obj, obj.docstring.value, public)
