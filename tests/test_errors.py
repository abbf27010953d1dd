"""One error base: every error rollfeed defines is a RollfeedError that keeps its place through
pickling (the way an error crosses from a DataLoader worker to the trainer)."""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil

import pytest

import rollfeed
from rollfeed.errors import RollfeedError


def _library_errors() -> list[type[BaseException]]:
    found = {}
    for info in pkgutil.walk_packages(rollfeed.__path__, "rollfeed."):
        if ".bench" in info.name or info.name.endswith("__main__"):
            continue  # entry points: importing them runs nothing of interest here
        module = importlib.import_module(info.name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__.startswith("rollfeed."):
                found[obj.__qualname__, obj.__module__] = obj
    return list(found.values())


ERRORS = _library_errors()


def test_the_library_defines_errors_to_check():
    assert len(ERRORS) >= 30


@pytest.mark.parametrize("cls", ERRORS, ids=lambda c: c.__name__)
def test_every_library_error_joins_the_one_base(cls):
    assert issubclass(cls, RollfeedError)
    assert issubclass(cls, ValueError)


@pytest.mark.parametrize(
    "cls", [c for c in ERRORS if c.__init__ is RollfeedError.__init__], ids=lambda c: c.__name__
)
def test_every_library_error_keeps_type_place_and_notes_through_pickling(cls):
    place = {name: f"{name}-{k}" for k, name in enumerate(cls.PLACE)}
    err = cls("what went wrong", **place)
    err.add_note("raised in a worker")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls
    assert back.place == place == {name: getattr(back, name) for name in cls.PLACE}
    assert str(back) == str(err) and all(str(v) in str(back) for v in place.values())
    assert back.__notes__ == ["raised in a worker"]


def test_an_unknown_place_name_is_a_type_error():
    class Family(RollfeedError):
        PLACE = ("file",)

    with pytest.raises(TypeError, match="places are"):
        Family("x", line=3)
    assert Family("x").file is None
