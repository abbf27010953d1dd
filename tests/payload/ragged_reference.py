"""The plain Python reference of the ragged_rows family (:mod:`tests.payload.adversary_ragged`):
what a ``RaggedRows`` call must give, from its arguments alone, on lists of rows, the grids of
arguments, and one case run against it.

An answer is :data:`REFUSE` (a misuse: only :class:`~rollfeed.payload.RaggedRowsError` is right)
or the rows / values it must return, exactly, of the right dtype.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import numpy as np
import torch

from tests.payload.adversary_tally import Tally, Wrong, typed

REFUSE = object()  # the reference's answer to a misuse
INTS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
DTYPES = (torch.bool, torch.float32, torch.float64, torch.int8, torch.int64, torch.uint8)
SPECIALS = (-1, 0, 1, 2, 5, 127, 255, 2**40, 2**62, 0.5, 2.0, math.nan, math.inf, -math.inf)
BASES = ([], [[]], [[7], [3, 9, 4], []], [[1], [2], [3], [4, 5], [], [6, 7, 8, 9]])
FILLS = (-1, 0, 1, 3.5, 2.0, True, math.nan, math.inf, -math.inf, 2**40, 2**63, 1e39, "x", None)
WIDTHS = (None, "longest", "longest+2", "longest-1", 0, -1, 2**40, 2**62, 1.5, True)
ROW_ARGS = (0, 1, 2, 3, 4, -1, 2**62, 0.5, 1.0, True, np.int64(1), torch.tensor(1), None)
ROW_ARGS += (torch.tensor(1.0),)
AS_BYTES = 1 << 30  # the family's address space: a larger padded form cannot be made


def holds(dtype: torch.dtype, v: float) -> bool:
    """Whether ``dtype`` holds ``v`` (exactly; a float dtype any number in its range)."""
    if dtype.is_floating_point:
        return not math.isfinite(v) or abs(v) <= torch.finfo(dtype).max
    if not math.isfinite(v) or v != int(v):
        return False
    low, high = (0, 1) if dtype == torch.bool else (torch.iinfo(dtype).min, torch.iinfo(dtype).max)
    return low <= int(v) <= high


def as_py(v: float, dtype: torch.dtype) -> float | int | bool:
    """``v`` as a ``dtype`` element's Python value."""
    if dtype == torch.bool:
        return bool(v)
    return float(v) if dtype.is_floating_point else int(v)


def arguments() -> list[tuple[str, object, list[int] | None]]:
    """``(description, argument, its integers when it is a 1-D integer tensor)``: tensors of
    every dtype and shape holding special values, and things that are not tensors."""
    out: list[tuple[str, object, list[int] | None]] = []
    for dtype in DTYPES:
        held = [v for v in SPECIALS if holds(dtype, v)]
        for values in ([], held[:1], held[:3], [0, 1], [1, 0, 1], [0, 1, 2, 2], held):
            values = [v for v in values if holds(dtype, v)]
            t = torch.tensor([as_py(v, dtype) for v in values], dtype=dtype)
            out.append(
                (f"{dtype} {values}", t, [int(v) for v in values] if dtype in INTS else None)
            )
            if values:
                out.append((f"{dtype} 2-D {values}", t.reshape(1, -1), None))
                out.append((f"{dtype} 0-D {values[0]}", t[0].clone(), None))
    out += [("list [0, 1]", [0, 1], None), ("None", None, None), ("int 1", 1, None)]
    return [*out, ("numpy [0, 1]", np.array([0, 1]), None)]


def rows_of(base: list[list[int]], dtype: torch.dtype) -> list[list]:
    return [[as_py(v % 2 if dtype == torch.bool else v, dtype) for v in r] for r in base]


def make_rows(rows: list[list], dtype: torch.dtype):
    from rollfeed.payload import RaggedRows

    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    return RaggedRows.from_lengths(lengths, torch.tensor([v for r in rows for v in r], dtype=dtype))


def same(a: object, b: object) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)


def equal_lists(got: list, want: list) -> bool:
    if isinstance(got, list) or isinstance(want, list):
        return (
            isinstance(got, list)
            and isinstance(want, list)
            and len(got) == len(want)
            and all(equal_lists(a, b) for a, b in zip(got, want, strict=True))
        )
    return same(got, want)


def rows_check(want: list[list], dtype: torch.dtype) -> Callable[[object], None]:
    """A check that a result is RaggedRows holding exactly ``want`` as ``dtype``."""

    def verify(got) -> None:
        off = got.offsets.tolist()
        rows = [got.values[a:b].tolist() for a, b in itertools.pairwise(off)]
        if got.dtype != dtype or got.offsets.dtype != torch.int64 or not equal_lists(rows, want):
            raise Wrong(f"got rows {rows} ({got.dtype}), want {want} ({dtype})")

    return verify


def run_case(tally: Tally, desc: str, attack: Callable[[], object], want, verify) -> None:
    """One call: ``want`` is :data:`REFUSE` or what ``verify`` holds the result to."""
    from rollfeed.payload import RaggedRowsError

    def run() -> None:
        try:
            got = attack()
        except RaggedRowsError:
            raise
        except Exception as err:
            if typed(err):
                raise Wrong(f"{type(err).__name__}, not RaggedRowsError: {err}") from None
            raise
        if want is REFUSE:
            raise Wrong(f"a misuse was taken: it returned {got!r:.200}")
        verify(got)

    tally.case(f"ragged_rows: {desc}", run, refusal_ok=want is REFUSE)


def row_number(v: object) -> int | None:
    """The reference's row number: an int (not bool), a NumPy integer, a one-element integer
    tensor."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int | np.integer):
        return int(v)
    if isinstance(v, torch.Tensor) and v.dtype in INTS and v.numel() == 1:
        return int(v.item())
    return None


def fill_of(fill: object, dtype: torch.dtype):
    """The fill as a ``dtype`` value, or :data:`REFUSE`."""
    if isinstance(fill, bool):
        fill = int(fill)
    if not isinstance(fill, int | float) or not holds(dtype, fill):
        return REFUSE
    return as_py(fill, dtype)
