"""The ragged_rows family: every entry point of ``RaggedRows`` over a grid of arguments (dtypes
bool / float / int8 / int64 / uint8, 0-D / 1-D / 2-D shapes, NaN / inf / negative / huge values,
things that are not tensors), against a plain Python reference on lists of rows.

The reference says, from the arguments alone, whether a call is a misuse (then the only right
outcome is :class:`~rollfeed.payload.RaggedRowsError`) or what it must return (then exactly
those rows, of that dtype; a refusal is wrong). Any other error, torch's ``RuntimeError`` or
``TypeError`` among them, is ``untyped``; another rollfeed error, or a misuse taken, ``wrong``.
Padded forms past the family's address space (1 GiB) must be refused.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from pathlib import Path

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


def _holds(dtype: torch.dtype, v: float) -> bool:
    """Whether ``dtype`` holds ``v`` (exactly; a float dtype any number in its range)."""
    if dtype.is_floating_point:
        return not math.isfinite(v) or abs(v) <= torch.finfo(dtype).max
    if not math.isfinite(v) or v != int(v):
        return False
    low, high = (0, 1) if dtype == torch.bool else (torch.iinfo(dtype).min, torch.iinfo(dtype).max)
    return low <= int(v) <= high


def _py(v: float, dtype: torch.dtype) -> float | int | bool:
    """``v`` as a ``dtype`` element's Python value."""
    if dtype == torch.bool:
        return bool(v)
    return float(v) if dtype.is_floating_point else int(v)


def arguments() -> list[tuple[str, object, list[int] | None]]:
    """``(description, argument, its integers when it is a 1-D integer tensor)``: tensors of
    every dtype and shape holding special values, and things that are not tensors."""
    out: list[tuple[str, object, list[int] | None]] = []
    for dtype in DTYPES:
        held = [v for v in SPECIALS if _holds(dtype, v)]
        for values in ([], held[:1], held[:3], [0, 1], [1, 0, 1], [0, 1, 2, 2], held):
            values = [v for v in values if _holds(dtype, v)]
            t = torch.tensor([_py(v, dtype) for v in values], dtype=dtype)
            out.append(
                (f"{dtype} {values}", t, [int(v) for v in values] if dtype in INTS else None)
            )
            if values:
                out.append((f"{dtype} 2-D {values}", t.reshape(1, -1), None))
                out.append((f"{dtype} 0-D {values[0]}", t[0].clone(), None))
    out += [("list [0, 1]", [0, 1], None), ("None", None, None), ("int 1", 1, None)]
    return [*out, ("numpy [0, 1]", np.array([0, 1]), None)]


def _rows_of(base: list[list[int]], dtype: torch.dtype) -> list[list]:
    return [[_py(v % 2 if dtype == torch.bool else v, dtype) for v in r] for r in base]


def _make(rows: list[list], dtype: torch.dtype):
    from rollfeed.payload import RaggedRows

    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    return RaggedRows.from_lengths(lengths, torch.tensor([v for r in rows for v in r], dtype=dtype))


def _same(a: object, b: object) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)


def _equal_lists(got: list, want: list) -> bool:
    if isinstance(got, list) or isinstance(want, list):
        return (
            isinstance(got, list)
            and isinstance(want, list)
            and len(got) == len(want)
            and all(_equal_lists(a, b) for a, b in zip(got, want, strict=True))
        )
    return _same(got, want)


def _rows(want: list[list], dtype: torch.dtype) -> Callable[[object], None]:
    """A check that a result is RaggedRows holding exactly ``want`` as ``dtype``."""

    def verify(got) -> None:
        off = got.offsets.tolist()
        rows = [got.values[a:b].tolist() for a, b in itertools.pairwise(off)]
        if got.dtype != dtype or got.offsets.dtype != torch.int64 or not _equal_lists(rows, want):
            raise Wrong(f"got rows {rows} ({got.dtype}), want {want} ({dtype})")

    return verify


def _case(tally: Tally, desc: str, attack: Callable[[], object], want, verify) -> None:
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


def _row_number(v: object) -> int | None:
    """The reference's row number: an int (not bool), a NumPy integer, a one-element integer
    tensor."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int | np.integer):
        return int(v)
    if isinstance(v, torch.Tensor) and v.dtype in INTS and v.numel() == 1:
        return int(v.item())
    return None


def _fill(fill: object, dtype: torch.dtype):
    """The fill as a ``dtype`` value, or :data:`REFUSE`."""
    if isinstance(fill, bool):
        fill = int(fill)
    if not isinstance(fill, int | float) or not _holds(dtype, fill):
        return REFUSE
    return _py(fill, dtype)


def family_ragged_rows(tally: Tally, workdir: Path, rng: np.random.Generator) -> None:
    """Every entry point over its grid (see the module doc)."""
    from rollfeed.payload import RaggedRows

    args = arguments()
    for desc, offsets, ints in args:  # the constructor
        nnz = ints[-1] if ints and 0 <= ints[-1] <= 100 else 3
        ok = (
            ints is not None
            and offsets.dtype == torch.int64
            and len(ints) >= 1
            and ints[0] == 0
            and all(a <= b for a, b in itertools.pairwise(ints))
            and ints[-1] == nnz
        )
        values = torch.arange(nnz, dtype=torch.float32)
        want = [values[a:b].tolist() for a, b in itertools.pairwise(ints)] if ok else REFUSE
        attack = lambda o=offsets, v=values: RaggedRows(o, v)  # noqa: E731
        _case(tally, f"RaggedRows({desc}, [{nnz}])", attack, want, _rows(want, torch.float32))
        for name, vals in (("2-D", values.reshape(1, -1)), ("a list", values.tolist())):
            attack = lambda o=offsets, v=vals: RaggedRows(o, v)  # noqa: E731
            _case(tally, f"RaggedRows({desc}, {name})", attack, REFUSE, None)
    for desc, lengths, ints in args:  # from_lengths
        total = sum(ints) if ints and min(ints) >= 0 and sum(ints) <= 100 else 3
        for nnz in (total, total + 1):
            values = torch.arange(nnz, dtype=torch.int64)
            ok = ints is not None and lengths.dim() == 1 and min(ints, default=0) >= 0
            ok = ok and sum(ints) == nnz
            off = list(itertools.accumulate(ints, initial=0)) if ok else []
            want = [values[a:b].tolist() for a, b in itertools.pairwise(off)] if ok else REFUSE
            attack = lambda n=lengths, v=values: RaggedRows.from_lengths(n, v)  # noqa: E731
            desc2 = f"from_lengths({desc}, [{nnz}])"
            _case(tally, desc2, attack, want, _rows(want, torch.int64))
    for b, base in enumerate(BASES):
        dtype = (torch.int32, torch.float32, torch.uint8, torch.bool)[b]
        rows = _rows_of(base, dtype)
        _one_base(tally, RaggedRows, rows, dtype, args)
        for dtype in DTYPES:
            _padding(tally, RaggedRows, _rows_of(base, dtype), dtype)


def _one_base(tally: Tally, RaggedRows, rows: list[list], dtype: torch.dtype, args) -> None:
    """take, rows, to, with_values, apply and equal over one value of ``rows``."""
    r, n = _make(rows, dtype), len(rows)
    nnz = sum(map(len, rows))
    here = f"{n} rows of {dtype}"
    for desc, index, ints in args:  # take
        ok = ints is not None and index.dim() == 1 and all(0 <= i < n for i in ints)
        want = [rows[i] for i in ints] if ok else REFUSE
        _case(tally, f"{here}: take({desc})", lambda i=index: r.take(i), want, _rows(want, dtype))
    for start, stop in itertools.product(ROW_ARGS, ROW_ARGS):  # rows
        a, b = _row_number(start), _row_number(stop)
        want = rows[a:b] if a is not None and b is not None and 0 <= a <= b <= n else REFUSE
        desc = f"{here}: rows({start!r}, {stop!r})"
        _case(tally, desc, lambda a=start, b=stop: r.rows(a, b), want, _rows(want, dtype))
    moves = (
        (("cpu",), {}, True),
        ((torch.device("cpu"),), {}, True),
        (("cpu:0",), {}, True),
        ((), {"device": "cpu"}, True),
        (("cpu",), {"non_blocking": True}, True),
        (("cpu",), {"copy": True}, True),
        ((), {}, False),
        ((torch.float32,), {}, False),
        ((), {"dtype": torch.int64}, False),
        (("cpu", torch.float32), {}, False),
        (("cpu",), {"dtype": torch.float64}, False),
        ((torch.zeros(1),), {}, False),
        (("float32",), {}, False),
        ((-1,), {}, False),
        ((True,), {}, False),
        ((None,), {}, False),
        (("cpu",), {"non_blocking": "yes"}, False),
        (("cpu",), {"memory_format": torch.contiguous_format}, False),
        (("cpu", "cpu"), {}, False),
    )
    for a, kw, ok in moves:  # to
        want = rows if ok else REFUSE
        _case(
            tally,
            f"{here}: to(*{a}, **{kw})",
            lambda a=a, kw=kw: r.to(*a, **kw),
            want,
            _rows(want, dtype),
        )
    for desc, values, _ in [*args, ("float [nnz]", torch.full((nnz,), 0.5), None)]:  # with_values
        ok = isinstance(values, torch.Tensor) and tuple(values.shape) == (nnz,)
        want = REFUSE
        if ok:
            flat = values.tolist()
            want = [
                flat[a:b]
                for a, b in itertools.pairwise(itertools.accumulate(map(len, rows), initial=0))
            ]
        check = _rows(want, values.dtype) if ok else None
        _case(tally, f"{here}: with_values({desc})", lambda v=values: r.with_values(v), want, check)
    fns = (
        ("clone", torch.clone, True),
        ("contiguous", torch.Tensor.contiguous, True),
        ("float", torch.Tensor.float, False),
        ("to int32", lambda t: t.to(torch.int32), False),
        ("a 2-D view", lambda t: t.reshape(1, -1), False),
        ("one fewer", lambda t: t[:-1], False),
        ("an int", 5, False),
        (
            "a tensor and a str",
            lambda t: t if t.dtype == torch.int64 else "x",
            dtype == torch.int64,
        ),
    )
    for name, fn, ok in fns:  # apply
        want = rows if ok else REFUSE
        _case(tally, f"{here}: apply({name})", lambda f=fn: r.apply(f), want, _rows(want, dtype))
    others = (
        ("the same rows", _make(rows, dtype), True),
        ("the same rows as float64", _make(rows, torch.float64), dtype == torch.float64),
        ("one row more", _make([*rows, [1]], dtype), False),
    )
    for name, other, same in others:  # equal

        def verify(got, same=same, name=name) -> None:
            if got is not same:
                raise Wrong(f"equal({name}) said {got}")

        _case(tally, f"{here}: equal({name})", lambda o=other: r.equal(o), True, verify)
    for name, other in (("a list", rows), ("a tensor", r.values), ("None", None)):
        _case(tally, f"{here}: equal({name})", lambda o=other: r.equal(o), REFUSE, None)


def _padding(tally: Tally, RaggedRows, rows: list[list], dtype: torch.dtype) -> None:
    """padded and from_padded over one value of ``rows`` of ``dtype``."""
    r, n = _make(rows, dtype), len(rows)
    longest = max(map(len, rows), default=0)
    here = f"{n} rows of {dtype}"
    named = {"longest": longest, "longest+2": longest + 2, "longest-1": longest - 1}
    for width, fill in itertools.product(WIDTHS, FILLS):
        w = named.get(width, width) if isinstance(width, str) else width
        v, cols = _fill(fill, dtype), longest if w is None else _row_number(w)
        fits = (
            cols is not None
            and cols >= max(longest, 0)
            and n * cols * r.values.element_size() < AS_BYTES
        )
        want = (
            REFUSE if v is REFUSE or not fits else [row + [v] * (cols - len(row)) for row in rows]
        )

        def verify(got, want=want, cols=cols) -> None:
            if (
                got.dtype != dtype
                or tuple(got.shape) != (n, cols)
                or not _equal_lists(got.tolist(), want)
            ):
                raise Wrong(f"padded gave {got.tolist()!r:.200} ({got.dtype}), want {want!r:.200}")

        attack = lambda w=w, f=fill: r.padded(w, fill=f)  # noqa: E731
        _case(tally, f"{here}: padded({w!r}, fill={fill!r})", attack, want, verify)
    grid = r.padded(longest + 1, fill=_py(0, dtype))
    for fill in FILLS:  # from_padded, trailing fill trimmed
        v = _fill(fill, dtype)
        want = REFUSE
        if v is not REFUSE:
            want = [
                row[: max((j + 1 for j, x in enumerate(row) if not _same(x, v)), default=0)]
                for row in grid.tolist()
            ]
        attack = lambda f=fill: RaggedRows.from_padded(grid, fill=f)  # noqa: E731
        _case(tally, f"{here}: from_padded(fill={fill!r})", attack, want, _rows(want, dtype))
    want = [] if n == 0 else REFUSE  # rows longer than the width: none when there are none
    likes = (
        ("its own rows", r, rows),
        ("a row more", _make([*rows, []], dtype), REFUSE),
        ("a longer row", _make([row + [_py(1, dtype)] * 2 for row in grid.tolist()], dtype), want),
        ("a list", rows, REFUSE),
    )
    for name, like, want in likes:
        attack = lambda like=like: RaggedRows.from_padded(grid, like=like)  # noqa: E731
        _case(tally, f"{here}: from_padded(like={name})", attack, want, _rows(want, dtype))
    for name, bad in (("1-D", grid.reshape(-1)), ("3-D", grid[None]), ("a list", grid.tolist())):
        _case(
            tally,
            f"{here}: from_padded({name})",
            lambda b=bad: RaggedRows.from_padded(b),
            REFUSE,
            None,
        )
