"""The one error base of rollfeed: the only module every package may import.

Every library error is a :class:`RollfeedError`, a ``ValueError`` (bad input or bad data, never
an internal bug), and names what it knows of the place where the problem is. Each error family
declares the names of its place (``PLACE``); ``str(err)`` carries every known one, so the text
alone survives any boundary, and pickling keeps the attributes too, so an error raised in a
DataLoader worker reaches the trainer with its type and its place.

Worked example::

    class PayloadError(RollfeedError):
        PLACE = ("file", "field", "offset", "pos")

    err = PayloadError("short read", file="step_1/w0.rfp", offset=64)
    str(err)   -> "short read [file=step_1/w0.rfp, offset=64]"
    err.field  -> None
    pickle.loads(pickle.dumps(err)).offset -> 64
"""

from __future__ import annotations

from typing import Any, ClassVar


class RollfeedError(ValueError):
    """Base class of every error rollfeed raises on purpose."""

    PLACE: ClassVar[tuple[str, ...]] = ()

    def __init__(self, message: str, **place: Any) -> None:
        unknown = sorted(set(place) - set(self.PLACE))
        if unknown:
            raise TypeError(f"{type(self).__name__} places are {self.PLACE}, not {unknown}")
        self.message = message
        for name in self.PLACE:
            setattr(self, name, place.get(name))
        where = [f"{k}={place[k]}" for k in self.PLACE if place.get(k) is not None]
        super().__init__(f"{message} [{', '.join(where)}]" if where else message)

    @property
    def place(self) -> dict[str, Any]:
        """``{name: value}`` of every place name of this error family (None when unknown)."""
        return {name: getattr(self, name) for name in self.PLACE}

    def with_place(self, **place: Any) -> RollfeedError:
        """The same error with the places it did not know yet filled in (e.g. the field)."""
        known = self.place
        known.update({k: v for k, v in place.items() if known.get(k) is None})
        return type(self)(self.message, **known)

    def __reduce__(self):  # the place survives pickling (worker -> trainer process)
        return (_rebuild, (type(self), self.message, self.place), self.__dict__)


def _rebuild(cls: type[RollfeedError], message: str, place: dict[str, Any]) -> RollfeedError:
    return cls(message, **place)
