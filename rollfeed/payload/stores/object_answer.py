"""How much of an object store's answer is read: never more than was asked for.

A ranged GET's answer is held to the range before a byte of its body is read: its status, its
``Content-Range`` (the first byte asked for, the last inside the range) and its
``Content-Length`` (the bytes that range names) must agree, else a typed
:class:`~rollfeed.payload.errors.PayloadIOError` names what the store claimed (a 206 claiming
2 GiB for a 256 KiB range is refused from its headers). A 200 to a ranged GET means the store
ignored ``Range``: taken only when it is the whole of an object the range covers, else named as
such. Any other answer (a listing, an error's body) is read up to :data:`ANSWER_BYTES`.

Example (a GET of bytes ``[0, 4096)`` of a 1000-byte object)::

    206, Content-Range: bytes 0-999/1000, Content-Length: 1000  -> ranged_length = (1000, 1000)
    206, Content-Range: bytes 0-2147483647/2147483648            -> PayloadIOError, nothing read
    200, Content-Length: 1000                                    -> (1000, 1000): the whole object
"""

from __future__ import annotations

import http.client
import re

from rollfeed.payload.errors import PayloadIOError

_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
ANSWER_BYTES = 64 << 20  # the most bytes of a listing's (or an error's) answer read


def _length(resp: http.client.HTTPResponse, where: str, rel: str) -> int | None:
    """The answer's ``Content-Length`` (``None`` when chunked), checked."""
    raw = resp.getheader("content-length")
    if raw is None:
        return None
    if not raw.strip().isdigit():
        raise PayloadIOError(f"{where} answered with Content-Length {raw[:40]!r}", file=rel)
    return int(raw)


def answer_body(resp: http.client.HTTPResponse, *, what: str, where: str, rel: str) -> bytes:
    """An answer's whole body, at most :data:`ANSWER_BYTES` (a longer one is refused unread)."""
    length = _length(resp, where, rel)
    if length is not None and length > ANSWER_BYTES:
        raise PayloadIOError(
            f"{where} answered {what} with {length} bytes, more than the {ANSWER_BYTES} an "
            "answer may take",
            file=rel,
        )
    text = resp.read(ANSWER_BYTES + 1 if length is None else length)
    if len(text) > ANSWER_BYTES:
        raise PayloadIOError(
            f"{where} answered {what} with more than {ANSWER_BYTES} bytes", file=rel
        )
    if length is not None and len(text) != length:
        raise http.client.IncompleteRead(text, length - len(text))
    return text


def ranged_length(
    resp: http.client.HTTPResponse, start: int, end: int, where: str, rel: str
) -> tuple[int, int]:
    """``(bytes to read, object size)`` of the answer to a GET of bytes ``[start, end)``, once
    its headers say it holds those bytes (or the first of them, at the object's end); else a
    typed error before any byte is read."""
    length = _length(resp, where, rel)
    asked = f"bytes [{start}, {end}) of {where}"
    if resp.status == 200:  # no Range honoured: only the whole of a small enough object will do
        if start == 0 and length is not None and length <= end:
            return length, length
        said = f"{length} bytes" if length is not None else "a body of unstated length"
        raise PayloadIOError(
            f"the store ignored Range: it answered a GET of {asked} with 200 and {said} (the "
            "whole object); use a store (or proxy) that serves ranged GETs with 206",
            file=rel,
            offset=start,
        )
    got = _RANGE.fullmatch((resp.getheader("content-range") or "").strip())
    first, last = (int(got.group(1)), int(got.group(2))) if got else (-1, -1)
    if got is None or first != start or not first <= last < end:
        raise PayloadIOError(
            f"the store answered a GET of {asked} with 206 and Content-Range "
            f"{resp.getheader('content-range')!r}: not the bytes asked for",
            file=rel,
            offset=start,
        )
    n = last - first + 1
    if length is not None and length != n:
        raise PayloadIOError(
            f"the store answered a GET of {asked} with Content-Length {length} for the {n} "
            f"bytes its Content-Range names; nothing of it was read",
            file=rel,
            offset=start,
        )
    return n, (int(got.group(3)) if got.group(3) != "*" else last + 1)
