"""What every command prints: names made safe to print, findings as text and as JSON records.

A finding is a :class:`~rollfeed.errors.RollfeedError` the command caught and reports. As JSON it
is one object: ``type`` (the error class), ``message``, then every place the error knows (for a
payload error ``file``, ``field``, ``offset``, ``pos``; keys it does not know are left out), then
what the command adds (e.g. the step file and line of a record).

Example::

    record(PayloadTruncatedError("cut short", file="g/w0.rfp", offset=64))
        -> {"type": "PayloadTruncatedError", "message": "cut short", "file": "g/w0.rfp",
            "offset": 64}
    line(same)  -> "g/w0.rfp: cut short [offset=64]"
"""

from __future__ import annotations

import json
from typing import Any, TextIO

from rollfeed.errors import RollfeedError

CLEAN, FINDINGS, USAGE = 0, 1, 2  # the exit statuses of every command


def shown(name: str) -> str:
    """``name`` as printed: quoted when it holds a newline, control or undecodable character."""
    try:
        name.encode()
    except UnicodeEncodeError:
        return ascii(name)
    return name if name.isprintable() else ascii(name)


def count(n: int, noun: str) -> str:
    """``"1 step file"``, ``"2 step files"``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def record(err: RollfeedError, **extra: Any) -> dict[str, Any]:
    """``err`` as a JSON-ready finding (module doc); ``extra`` keys come after its places."""
    out: dict[str, Any] = {"type": type(err).__name__, "message": err.message}
    out.update({k: v for k, v in err.place.items() if v is not None})
    out.update(extra)
    return out


def line(err: RollfeedError, *, where: str = "file") -> str:
    """``err`` as one line: its ``where`` place (``.`` when unknown), the message, the other
    places in brackets."""
    place = [f"{k}={shown(str(v))}" for k, v in err.place.items() if v is not None and k != where]
    tail = f" [{', '.join(place)}]" if place else ""
    return f"{shown(str(err.place.get(where) or '.'))}: {shown(err.message)}{tail}"


def write_json(report: dict[str, Any], stream: TextIO) -> None:
    """``report`` as one JSON object on ``stream`` (ASCII: any file name survives)."""
    json.dump(report, stream, indent=1)
    stream.write("\n")
