"""The ragged_rows family: every entry point of ``RaggedRows`` over a grid of arguments (dtypes
bool / float / int8 / int64 / uint8, 0-D / 1-D / 2-D shapes, NaN / inf / negative / huge values,
things that are not tensors), against a plain Python reference on lists of rows
(:mod:`tests.payload.ragged_reference`).

The reference says, from the arguments alone, whether a call is a misuse (then the only right
outcome is :class:`~rollfeed.payload.RaggedRowsError`) or what it must return (then exactly
those rows, of that dtype; a refusal is wrong). Any other error, torch's ``RuntimeError`` or
``TypeError`` among them, is ``untyped``; another rollfeed error, or a misuse taken, ``wrong``.
Padded forms past the family's address space (1 GiB) must be refused.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import torch

from tests.payload.adversary_tally import Tally, Wrong
from tests.payload.ragged_reference import (
    AS_BYTES,
    BASES,
    DTYPES,
    FILLS,
    REFUSE,
    ROW_ARGS,
    WIDTHS,
    arguments,
    as_py,
    equal_lists,
    fill_of,
    make_rows,
    row_number,
    rows_check,
    rows_of,
    run_case,
    same,
)


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
        run_case(
            tally, f"RaggedRows({desc}, [{nnz}])", attack, want, rows_check(want, torch.float32)
        )
        for name, vals in (("2-D", values.reshape(1, -1)), ("a list", values.tolist())):
            attack = lambda o=offsets, v=vals: RaggedRows(o, v)  # noqa: E731
            run_case(tally, f"RaggedRows({desc}, {name})", attack, REFUSE, None)
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
            run_case(tally, desc2, attack, want, rows_check(want, torch.int64))
    for b, base in enumerate(BASES):
        dtype = (torch.int32, torch.float32, torch.uint8, torch.bool)[b]
        rows = rows_of(base, dtype)
        _one_base(tally, RaggedRows, rows, dtype, args)
        for dtype in DTYPES:
            _padding(tally, RaggedRows, rows_of(base, dtype), dtype)


def _one_base(tally: Tally, RaggedRows, rows: list[list], dtype: torch.dtype, args) -> None:
    """take, rows, to, with_values, apply and equal over one value of ``rows``."""
    r, n = make_rows(rows, dtype), len(rows)
    nnz = sum(map(len, rows))
    here = f"{n} rows of {dtype}"
    for desc, index, ints in args:  # take
        ok = ints is not None and index.dim() == 1 and all(0 <= i < n for i in ints)
        want = [rows[i] for i in ints] if ok else REFUSE
        run_case(
            tally, f"{here}: take({desc})", lambda i=index: r.take(i), want, rows_check(want, dtype)
        )
    for start, stop in itertools.product(ROW_ARGS, ROW_ARGS):  # rows
        a, b = row_number(start), row_number(stop)
        want = rows[a:b] if a is not None and b is not None and 0 <= a <= b <= n else REFUSE
        desc = f"{here}: rows({start!r}, {stop!r})"
        run_case(tally, desc, lambda a=start, b=stop: r.rows(a, b), want, rows_check(want, dtype))
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
        run_case(
            tally,
            f"{here}: to(*{a}, **{kw})",
            lambda a=a, kw=kw: r.to(*a, **kw),
            want,
            rows_check(want, dtype),
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
        check = rows_check(want, values.dtype) if ok else None
        run_case(
            tally, f"{here}: with_values({desc})", lambda v=values: r.with_values(v), want, check
        )
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
        run_case(
            tally, f"{here}: apply({name})", lambda f=fn: r.apply(f), want, rows_check(want, dtype)
        )
    others = (
        ("the same rows", make_rows(rows, dtype), True),
        ("the same rows as float64", make_rows(rows, torch.float64), dtype == torch.float64),
        ("one row more", make_rows([*rows, [1]], dtype), False),
    )
    for name, other, alike in others:  # equal

        def verify(got, alike=alike, name=name) -> None:
            if got is not alike:
                raise Wrong(f"equal({name}) said {got}")

        run_case(tally, f"{here}: equal({name})", lambda o=other: r.equal(o), True, verify)
    for name, other in (("a list", rows), ("a tensor", r.values), ("None", None)):
        run_case(tally, f"{here}: equal({name})", lambda o=other: r.equal(o), REFUSE, None)


def _padding(tally: Tally, RaggedRows, rows: list[list], dtype: torch.dtype) -> None:
    """padded and from_padded over one value of ``rows`` of ``dtype``."""
    r, n = make_rows(rows, dtype), len(rows)
    longest = max(map(len, rows), default=0)
    here = f"{n} rows of {dtype}"
    named = {"longest": longest, "longest+2": longest + 2, "longest-1": longest - 1}
    for width, fill in itertools.product(WIDTHS, FILLS):
        w = named.get(width, width) if isinstance(width, str) else width
        v, cols = fill_of(fill, dtype), longest if w is None else row_number(w)
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
                or not equal_lists(got.tolist(), want)
            ):
                raise Wrong(f"padded gave {got.tolist()!r:.200} ({got.dtype}), want {want!r:.200}")

        attack = lambda w=w, f=fill: r.padded(w, fill=f)  # noqa: E731
        run_case(tally, f"{here}: padded({w!r}, fill={fill!r})", attack, want, verify)
    grid = r.padded(longest + 1, fill=as_py(0, dtype))
    for fill in FILLS:  # from_padded, trailing fill trimmed
        v = fill_of(fill, dtype)
        want = REFUSE
        if v is not REFUSE:
            want = [
                row[: max((j + 1 for j, x in enumerate(row) if not same(x, v)), default=0)]
                for row in grid.tolist()
            ]
        attack = lambda f=fill: RaggedRows.from_padded(grid, fill=f)  # noqa: E731
        run_case(
            tally, f"{here}: from_padded(fill={fill!r})", attack, want, rows_check(want, dtype)
        )
    want = [] if n == 0 else REFUSE  # rows longer than the width: none when there are none
    likes = (
        ("its own rows", r, rows),
        ("a row more", make_rows([*rows, []], dtype), REFUSE),
        (
            "a longer row",
            make_rows([row + [as_py(1, dtype)] * 2 for row in grid.tolist()], dtype),
            want,
        ),
        ("a list", rows, REFUSE),
    )
    for name, like, want in likes:
        attack = lambda like=like: RaggedRows.from_padded(grid, like=like)  # noqa: E731
        run_case(tally, f"{here}: from_padded(like={name})", attack, want, rows_check(want, dtype))
    for name, bad in (("1-D", grid.reshape(-1)), ("3-D", grid[None]), ("a list", grid.tolist())):
        run_case(
            tally,
            f"{here}: from_padded({name})",
            lambda b=bad: RaggedRows.from_padded(b),
            REFUSE,
            None,
        )
