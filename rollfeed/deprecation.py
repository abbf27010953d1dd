"""Renamed public names, kept working for one release: each use of an old name warns.

A renamed name keeps working until the next release, and every use of it raises a
``DeprecationWarning`` that names the new one. Four kinds of name, one helper each:

- a name of a package (``from rollfeed.objectives import KeptDistribution``):
  :func:`renamed_names` makes the package's module ``__getattr__``, so the old name is not in
  ``__all__`` nor in the package's namespace;
- an attribute of a class (``scores.kept_logprobs``): :func:`renamed_attribute`, a property;
- a keyword argument (``score(mb, return_kept_logprobs=True)``): :func:`renamed_keywords`, a
  decorator (giving both the old and the new keyword is a ``TypeError``);
- a key of a metrics dict (``loader.metrics["kept_rows"]``): a :class:`RenamedKeys` subclass,
  whose lookups (``m[old]``, ``m.get(old)``) read the new key; iteration, ``in``, ``len`` and
  JSON see only the new keys.

Example::

    __getattr__ = renamed_names(__name__, {"KeptDistribution": "SupportDistribution"})

    from rollfeed.objectives import KeptDistribution
    -> DeprecationWarning: rollfeed.objectives.KeptDistribution is deprecated: use
       rollfeed.objectives.SupportDistribution (the old name goes in the next release)

Like :mod:`rollfeed.errors`, a leaf every package may import: it imports nothing of ours.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


def warn_renamed(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that ``old`` is deprecated in favour of ``new`` (``stacklevel`` 3: the caller of the
    function that calls this)."""
    warnings.warn(
        f"{old} is deprecated: use {new} (the old name goes in the next release)",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def renamed_names(module: str, renamed: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` serving each old name of ``renamed`` (old -> new) as the module's
    new name, with a warning; any other missing name is an ``AttributeError``."""

    def __getattr__(name: str) -> Any:
        new = renamed.get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warn_renamed(f"{module}.{name}", f"{module}.{new}")
        return getattr(sys.modules[module], new)

    return __getattr__


def renamed_attribute(owner: str, old: str, new: str) -> property:
    """A read-only property ``old`` of class ``owner`` that reads attribute ``new``."""

    def get(self: Any) -> Any:
        warn_renamed(f"{owner}.{old}", f"{owner}.{new}")
        return getattr(self, new)

    return property(get, doc=f"Deprecated: use ``{new}``.")


def renamed_keywords(owner: str, **renamed: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a function whose keyword parameters were renamed (``old="new"``): a call with an
    old keyword warns and passes it as the new one; giving both is a ``TypeError``."""

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            for old, new in renamed.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{owner}() got {old}= and {new}=; give only {new}=")
                    warn_renamed(f"{owner}({old}=...)", f"{owner}({new}=...)")
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return call

    return decorate


class RenamedKeys(dict[str, Any]):
    """A metrics dict whose renamed keys still read, with a warning (the subclass's ``renamed``:
    old key -> new key, and ``owner``: what the dict is, for the message)."""

    owner: ClassVar[str] = "metrics"
    renamed: ClassVar[Mapping[str, str]] = {}

    def __missing__(self, key: str) -> Any:
        new = self.renamed.get(key)
        if new is None or new not in self:
            raise KeyError(key)
        warn_renamed(f"{self.owner}[{key!r}]", f"{self.owner}[{new!r}]")
        return self[new]

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        if key in self or key not in self.renamed or self.renamed[key] not in self:
            return super().get(key, default)
        warn_renamed(f"{self.owner}[{key!r}]", f"{self.owner}[{self.renamed[key]!r}]")
        return self[self.renamed[key]]

    def copy(self) -> RenamedKeys:  # type: ignore[override]
        return type(self)(self)
