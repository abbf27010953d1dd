"""RaggedRows: rows of different lengths as one flat value tensor and row offsets (CSR).

A kept set is ragged and heavy-tailed (most rows hold one or two ids, a few hold hundreds), so a
micro batch carries it as ``offsets [n + 1]`` int64 and ``values [nnz]``: row ``i`` is
``values[offsets[i]:offsets[i + 1]]``. Its cost is ``8·(n + 1) + itemsize·nnz`` bytes, not
``itemsize·n·W`` for the widest row ``W``. Values aligned slot for slot with another ragged field
(the sampler's logprob of every kept id) share its offsets.

Worked example: rows ``[7]``, ``[3, 9, 4]``, ``[]``::

    offsets [0, 1, 4, 4]   values [7, 3, 9, 4]   lengths() [1, 3, 0]   nnz 4
    padded(fill=-1)           -> [[7, -1, -1], [3, 9, 4], [-1, -1, -1]]
    from_padded(that, fill=-1) -> the same rows (trailing fill trimmed)
    rows(1, 3)                -> offsets [0, 3, 3]   values [3, 9, 4]
    take([2, 0])              -> offsets [0, 0, 1]   values [7]

The value is frozen; :meth:`RaggedRows.apply` maps both tensors (device moves, pinning, a shared
buffer), so it travels wherever a tensor of a micro batch does. On CPU the offsets are checked
when the value is made (``offsets[0] == 0``, non-decreasing, ``offsets[-1] == nnz``); on an
accelerator that check would cost a host sync, so a value made there is trusted to come from a
checked one.

Every argument is checked too (:mod:`~rollfeed.payload.ragged_args`): lengths and row indices
are 1-D integer tensors (a boolean mask or float indices are refused, not read as row numbers), a
fill is a number the rows' dtype holds (3.5 for int rows is refused, not written as 3), ``to``
moves between devices only (a dtype would convert the offsets). Each misuse is a
:class:`RaggedRowsError` naming the method, the argument, what it got and what it needs. Rows a
reader made (:meth:`RaggedRows.trusted`) skip every check.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from rollfeed.payload.errors import RaggedRowsError
from rollfeed.payload.ragged_args import (
    applied,
    device_move,
    fill_value,
    integer_tensor,
    row_number,
    tensor,
)
from rollfeed.payload.ragged_pad import NUMPY_DTYPES, pad_serially


@dataclasses.dataclass(frozen=True)
class RaggedRows:
    """``n`` rows of one dtype: ``offsets [n + 1]`` int64, ``values [nnz]`` (see module doc)."""

    offsets: torch.Tensor
    values: torch.Tensor

    def __post_init__(self) -> None:
        off = tensor(self.offsets, "RaggedRows", "offsets", "a 1-D int64 tensor [n + 1]")
        val = tensor(self.values, "RaggedRows", "values", "a 1-D tensor [nnz]")
        if off.dtype != torch.int64 or off.dim() != 1 or off.numel() < 1:
            raise RaggedRowsError(
                f"offsets must be a 1-D int64 tensor of n + 1 >= 1 entries, got "
                f"{off.dtype} of shape {tuple(off.shape)}"
            )
        if val.dim() != 1:
            raise RaggedRowsError(f"values must be 1-D [nnz], got shape {tuple(val.shape)}")
        if off.device != val.device:
            raise RaggedRowsError(f"offsets on {off.device} but values on {val.device}")
        if off.device.type != "cpu":
            return
        steps = off.diff()
        if int(off[0]) != 0 or int(off[-1]) != val.numel() or bool((steps < 0).any()):
            bad = int(torch.nonzero(steps < 0)[0]) if bool((steps < 0).any()) else None
            raise RaggedRowsError(
                f"offsets must start at 0, never decrease and end at nnz = {val.numel()}: "
                f"got first {int(off[0])}, last {int(off[-1])}"
                + (f", a decrease after row {bad}" if bad is not None else "")
            )

    @classmethod
    def trusted(cls, offsets: torch.Tensor, values: torch.Tensor) -> RaggedRows:
        """Rows not checked again: for a maker that guarantees them (the payload reader, which
        checked every index it decoded, and :meth:`apply`); anything else uses ``RaggedRows()``."""
        out = object.__new__(cls)
        object.__setattr__(out, "offsets", offsets)
        object.__setattr__(out, "values", values)
        return out

    @classmethod
    def from_lengths(cls, lengths: torch.Tensor, values: torch.Tensor) -> RaggedRows:
        """Rows of ``lengths [n]`` (integers >= 0) over ``values [sum(lengths)]``."""
        lengths = integer_tensor(lengths, "from_lengths", "lengths", "row lengths >= 0")
        values = tensor(values, "from_lengths", "values", "a 1-D tensor [sum(lengths)]")
        if values.dim() != 1:
            raise RaggedRowsError(
                f"from_lengths: values must be a 1-D tensor [sum(lengths)], got shape "
                f"{tuple(values.shape)}"
            )
        lengths = lengths.to(device=values.device, dtype=torch.int64)
        if lengths.device.type == "cpu" and lengths.numel():
            if int(lengths.min()) < 0:
                at = int(torch.nonzero(lengths < 0)[0])
                raise RaggedRowsError(
                    f"from_lengths: lengths must be >= 0, got lengths[{at}] = {int(lengths[at])}"
                )
            offsets = _offsets(lengths)
            if int(offsets[-1]) != values.numel() or int(lengths.max()) > values.numel():
                raise RaggedRowsError(
                    f"from_lengths: lengths must sum to the {values.numel()} values, got a sum "
                    f"of {int(lengths.sum())}"
                )
            return cls(offsets, values)
        return cls(_offsets(lengths), values)

    @classmethod
    def from_padded(
        cls, padded: torch.Tensor, *, fill: float | int = -1, like: RaggedRows | None = None
    ) -> RaggedRows:
        """Rows of ``padded [n, W]``: each row up to its last slot that is not ``fill`` (a fill
        before that slot is kept: the read form's empty label place), or, with ``like``, the rows
        of ``like``'s lengths (values aligned with another field's rows)."""
        padded = tensor(padded, "from_padded", "padded", "a 2-D tensor [n, W]")
        if padded.dim() != 2:
            raise RaggedRowsError(
                f"from_padded: padded must be a 2-D tensor [n, W], got shape {tuple(padded.shape)}"
            )
        n, width = padded.shape
        if like is not None:
            if not isinstance(like, RaggedRows):
                raise RaggedRowsError(
                    f"from_padded: like must be RaggedRows, got {type(like).__name__}"
                )
            if like.n_rows != n:
                raise RaggedRowsError(f"{n} padded rows cannot follow {like.n_rows} rows")
            lengths = like.lengths()
            if lengths.numel() and int(lengths.max()) > width:
                raise RaggedRowsError(f"a row of {int(lengths.max())} does not fit width {width}")
        else:
            fill = fill_value(fill, padded.dtype, "from_padded")
            held = padded != fill
            if padded.is_floating_point() and fill != fill:
                held = ~padded.isnan()
            cols = torch.arange(1, width + 1, device=padded.device)
            lengths = (held * cols).amax(dim=1) if width else padded.new_zeros(n, dtype=torch.int64)
        keep = torch.arange(width, device=padded.device) < lengths.to(padded.device)[:, None]
        return cls.from_lengths(lengths, padded[keep])

    @property
    def n_rows(self) -> int:
        return self.offsets.numel() - 1

    @property
    def nnz(self) -> int:
        return self.values.numel()

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def nbytes(self) -> int:
        return self.offsets.nbytes + self.values.nbytes

    def lengths(self) -> torch.Tensor:
        """``[n]`` int64, each row's length."""
        return self.offsets.diff()

    def row_index(self) -> torch.Tensor:
        """``[nnz]`` int64, the row of every value (example: ``[0, 1, 1, 1]``)."""
        rows = torch.arange(self.n_rows, device=self.device)
        return torch.repeat_interleave(rows, self.lengths(), output_size=self.nnz)

    def width(self) -> int:
        """The longest row's length (a host sync on an accelerator); 0 for no rows."""
        return int(self.lengths().max()) if self.n_rows else 0

    def padded(self, width: int | None = None, *, fill: float | int = -1) -> torch.Tensor:
        """``[n, width]`` with each row left-aligned and ``fill`` after it; ``width`` defaults to
        the longest row; ``fill`` a number the rows' dtype holds. Raises
        :class:`RaggedRowsError` if a row is longer than ``width``, or the padded form cannot be
        allocated."""
        fill = fill_value(fill, self.dtype, "padded")
        longest = self.width()
        width = longest if width is None else row_number(width, "padded", "width")
        if longest > width or width < 0:
            raise RaggedRowsError(
                f"padded: width must be >= 0 and hold the longest row, {longest} values, got "
                f"width {width}"
                f": a row of {longest} values does not fit width {width}"
            )
        size = self.n_rows * width * self.values.element_size()
        serial = self.device.type == "cpu" and not self.values.requires_grad
        serial = serial and self.dtype in NUMPY_DTYPES
        try:
            if size >= 1 << 63:
                raise RuntimeError("its size overflows int64")
            shape = (self.n_rows, width)
            out = (
                torch.empty(shape, dtype=self.dtype)
                if serial
                else torch.full(shape, fill, dtype=self.dtype, device=self.device)
            )
        except RuntimeError as err:  # the allocation (or its size) failed
            raise RaggedRowsError(
                f"padded: [{self.n_rows}, {width}] {self.dtype} ({size} bytes) cannot be made: "
                f"{str(err).splitlines()[0][:120]}"
            ) from None
        if serial and out.numel():
            pad_serially(out.numpy(), self.offsets.numpy(), self.values.numpy(), fill)
        if serial:
            return out
        rows = self.row_index()
        cols = torch.arange(self.nnz, device=self.device) - self.offsets[rows]
        out[rows, cols] = self.values
        return out

    def rows(self, start: int, stop: int) -> RaggedRows:
        """Rows ``start .. stop - 1`` (ints, ``0 <= start <= stop <= n``) with re-based
        offsets; the values are a view."""
        start, stop = row_number(start, "rows", "start"), row_number(stop, "rows", "stop")
        if not 0 <= start <= stop <= self.n_rows:
            raise RaggedRowsError(
                f"rows: start and stop must satisfy 0 <= start <= stop <= {self.n_rows}, got "
                f"rows {start}..{stop}, outside 0..{self.n_rows}"
            )
        off = self.offsets[start : stop + 1]
        first, last = (int(off[0]), int(off[-1]))
        return RaggedRows(off - first, self.values[first:last])

    def take(self, index: torch.Tensor) -> RaggedRows:
        """The rows ``index [m]`` (a 1-D integer tensor, in that order, repeats allowed),
        re-based."""
        index = integer_tensor(index, "take", "index")
        index = index.to(device=self.device, dtype=torch.int64)
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= self.n_rows):
            bad = int(index[(index < 0) | (index >= self.n_rows)][0])
            raise RaggedRowsError(
                f"take: index must hold row numbers in 0..{self.n_rows - 1}, got {bad}: row "
                f"index outside 0..{self.n_rows - 1}"
            )
        lengths = self.lengths()[index]
        offsets = _offsets(lengths)
        total = int(offsets[-1])
        starts = self.offsets[index] - offsets[:-1]
        source = torch.arange(total, device=self.device) + torch.repeat_interleave(
            starts, lengths, output_size=total
        )
        return RaggedRows(offsets, self.values[source])

    def with_values(self, values: torch.Tensor) -> RaggedRows:
        """The same rows over other values aligned slot for slot (``[nnz]``, any dtype)."""
        values = tensor(values, "with_values", "values", f"a tensor of shape [{self.nnz}]")
        if values.shape != self.values.shape:
            raise RaggedRowsError(
                f"aligned values must have shape {tuple(self.values.shape)}, got "
                f"{tuple(values.shape)}"
            )
        return RaggedRows(self.offsets, values)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(offsets, values)``."""
        return self.offsets, self.values

    def apply(self, fn: Callable[[torch.Tensor], Any]) -> RaggedRows:
        """A copy with ``fn`` applied to the offsets and the values, their bytes not checked
        again: ``fn`` moves or copies bytes (a device, pinned or shared buffer), it does not
        change rows. Tensors it returns keep their kind (offsets 1-D int64, values 1-D, both of
        the same lengths and on one device), else :class:`RaggedRowsError`. (A loader's
        hand-over maps the two to buffer slots this way, and back.)"""
        if not callable(fn):
            raise RaggedRowsError(f"apply: fn must be callable, got {type(fn).__name__}")
        offsets, values = fn(self.offsets), fn(self.values)
        applied(self.offsets, self.values, offsets, values)
        return RaggedRows.trusted(offsets, values)

    def to(self, *args: Any, **kwargs: Any) -> RaggedRows:
        """Device moves only: ``rows.to("cuda")``, ``rows.to(device, non_blocking=True)``,
        ``copy=True``; a dtype (which would convert the offsets too) is refused: convert the
        values with ``rows.with_values(rows.values.to(dtype))``."""
        moves = device_move(args, kwargs)
        return self.apply(lambda t: t.to(**moves))

    def pin_memory(self) -> RaggedRows:
        return self.apply(torch.Tensor.pin_memory)

    def equal(self, other: RaggedRows) -> bool:
        """Bitwise equality of rows and values (dtype included)."""
        if not isinstance(other, RaggedRows):
            raise RaggedRowsError(f"equal: other must be RaggedRows, got {type(other).__name__}")
        return (
            self.dtype == other.dtype
            and torch.equal(self.offsets, other.offsets)
            and torch.equal(self.values, other.values)
        )


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    """``[n + 1]`` int64 offsets of rows of ``lengths [n]``: ``[2, 0, 3]`` -> ``[0, 2, 2, 5]``."""
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths.to(torch.int64), 0, out=offsets[1:])
    return offsets
