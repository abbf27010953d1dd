"""The arguments :class:`~rollfeed.payload.RaggedRows` takes, checked: each misuse is a
:class:`~rollfeed.payload.errors.RaggedRowsError` naming the method, the argument, what it got and
what it needs, never a value read some other way (a boolean mask or float indices read as row
numbers, a fill of 3.5 written as 3 into int rows) nor torch's own ``RuntimeError``.

Only arguments are checked here (types, dtypes, shapes, Python numbers); the rows' own invariants
are :class:`~rollfeed.payload.RaggedRows`'s. Rows a reader made (``RaggedRows.trusted``) pass
through none of this.

Example::

    integer_tensor(torch.tensor([True, False]), "take", "index")
    -> RaggedRowsError: take: index must be a 1-D integer tensor of row numbers, got torch.bool
       of shape (2,) (a boolean mask selects rows with index.nonzero().flatten())
    fill_value(3.5, torch.int32, "padded")  -> RaggedRowsError (3.5 is not an int32 value)
    fill_value(-1, torch.float32, "padded") -> -1
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any

import torch

from rollfeed.payload.errors import RaggedRowsError

INTEGER_DTYPES = frozenset(
    {
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint16,
        torch.uint32,
        torch.uint64,
    }
)
_DEVICE_KEYWORDS = frozenset({"device", "non_blocking", "copy"})


def _got(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r:.80}"


def tensor(value: object, method: str, name: str, needs: str) -> torch.Tensor:
    """``value`` if it is a tensor, else the error naming ``method``, ``name`` and ``needs``."""
    if not isinstance(value, torch.Tensor):
        raise RaggedRowsError(f"{method}: {name} must be {needs}, got {_got(value)}")
    return value


def integer_tensor(
    value: object, method: str, name: str, what: str = "row numbers"
) -> torch.Tensor:
    """``value``, a 1-D tensor of an integer dtype (not bool, not floating)."""
    needs = f"a 1-D integer tensor of {what}"
    t = tensor(value, method, name, needs)
    if t.dtype not in INTEGER_DTYPES or t.dim() != 1:
        hint = ""
        if t.dtype == torch.bool:
            hint = f" (a boolean mask selects rows with {name}.nonzero().flatten())"
        elif t.dtype.is_floating_point:
            hint = f" (round it and convert it first: {name}.round().long())"
        raise RaggedRowsError(f"{method}: {name} must be {needs}, got {_got(t)}{hint}")
    return t


def row_number(value: object, method: str, name: str) -> int:
    """``value`` as a Python int (an int, a NumPy integer, a one-element integer tensor); a
    ``bool``, a float or anything else is refused."""
    numeric = not isinstance(value, torch.Tensor) or value.dtype in INTEGER_DTYPES
    if numeric and not isinstance(value, bool):
        try:
            return operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
    raise RaggedRowsError(f"{method}: {name} must be an int row number, got {_got(value)}")


def fill_value(fill: object, dtype: torch.dtype, method: str) -> Any:
    """``fill`` as a Python number that ``dtype`` holds exactly (a float one holds any number in
    its range, rounded; NaN and infinities too): refused otherwise."""
    needs = f"a number that {dtype} rows hold"
    if isinstance(fill, bool):
        fill = int(fill)
    if not isinstance(fill, numbers.Number) or (
        isinstance(fill, numbers.Complex)
        and not isinstance(fill, numbers.Real)
        and not dtype.is_complex
    ):
        raise RaggedRowsError(f"{method}: fill must be {needs}, got {_got(fill)}")
    if dtype.is_complex:
        return fill
    if dtype.is_floating_point:
        try:
            value = float(fill)  # type: ignore[arg-type]
        except OverflowError:
            value = math.inf
        if math.isfinite(value) and abs(value) > torch.finfo(dtype).max:
            raise RaggedRowsError(
                f"{method}: fill {fill!r:.40} is outside the range of {dtype} "
                f"(|fill| <= {torch.finfo(dtype).max:.6g})"
            )
        return value
    value = fill
    if not isinstance(fill, numbers.Integral):
        as_float = float(fill)  # type: ignore[arg-type]
        if not as_float.is_integer():
            raise RaggedRowsError(
                f"{method}: fill must be {needs}, got {fill!r:.40}, not an integer ({dtype})"
            )
        value = int(as_float)
    value = int(value)  # type: ignore[call-overload]
    low, high = (0, 1) if dtype == torch.bool else (torch.iinfo(dtype).min, torch.iinfo(dtype).max)
    if not low <= value <= high:
        raise RaggedRowsError(
            f"{method}: fill must be {needs}, got {fill!r:.40}, outside [{low}, {high}]"
        )
    return bool(value) if dtype == torch.bool else value


def device_move(args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``Tensor.to`` for a move that ``RaggedRows.to(*args,
    **kwargs)`` asks for: one device (positional or ``device=``), ``non_blocking``, ``copy``;
    a dtype, another tensor or anything else is refused."""
    given = (*args, *kwargs.values())
    if "dtype" in kwargs or any(isinstance(a, torch.dtype) for a in given):
        raise RaggedRowsError(
            f"to: moves rows between devices only, got a dtype in {given!r:.80}: it would "
            "convert the offsets too; convert the values with "
            "rows.with_values(rows.values.to(dtype))"
        )
    if any(isinstance(a, torch.Tensor) for a in given):
        raise RaggedRowsError(
            "to: takes a device, not a tensor (whose dtype would convert the offsets too): "
            "pass other.device"
        )
    moves = dict(kwargs)
    if set(kwargs) - _DEVICE_KEYWORDS or len(args) > 1 or (args and "device" in kwargs):
        raise RaggedRowsError(
            f"to: takes one device and non_blocking / copy, got arguments {args!r:.80} and "
            f"keywords {sorted(kwargs)}"
        )
    if args:
        moves["device"] = args[0]
    device = moves.get("device")
    if isinstance(device, bool) or not isinstance(device, torch.device | str | int):
        raise RaggedRowsError(f"to: device must be a torch.device, str or int, got {_got(device)}")
    try:
        moves["device"] = torch.device(device)
    except RuntimeError as err:
        raise RaggedRowsError(f"to: device {device!r} is not a device: {err}") from None
    for flag in ("non_blocking", "copy"):
        if not isinstance(moves.get(flag, False), bool):
            raise RaggedRowsError(f"to: {flag} must be a bool, got {_got(moves[flag])}")
    return moves


def applied(offsets: Any, values: Any, new_offsets: Any, new_values: Any) -> None:
    """What ``RaggedRows.apply``'s ``fn`` made of ``offsets`` and ``values``, held to their kind
    when it made tensors (metadata only: no byte is read): offsets 1-D int64, values 1-D, the
    same lengths as before, on one device."""
    made = isinstance(new_offsets, torch.Tensor), isinstance(new_values, torch.Tensor)
    if not any(made):
        return  # descriptions of the tensors (a hand-over's buffer slots)
    were = isinstance(offsets, torch.Tensor) and isinstance(values, torch.Tensor)
    fine = (
        all(made)
        and new_offsets.dtype == torch.int64
        and new_offsets.dim() == 1
        and new_values.dim() == 1
        and new_offsets.device == new_values.device
        and (
            not were
            or (new_offsets.numel(), new_values.numel()) == (offsets.numel(), values.numel())
        )
    )
    if not fine:
        raise RaggedRowsError(
            "apply: fn must move or copy the tensors, not change them: offsets must stay 1-D "
            f"int64 [n + 1] and values 1-D [nnz] on one device, got {_kind(new_offsets)} and "
            f"{_kind(new_values)}"
        )


def _kind(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} {tuple(t.shape)} on {t.device}"
    return type(t).__name__
