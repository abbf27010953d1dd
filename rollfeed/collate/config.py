"""PlanConfig: the planner's options, one frozen value for every stage that plans or places.

``prepare_batch``, the loader's sampler and collator and ``build_dataloader`` all take it; runtime
facts (DP size, topology, payload root) stay separate arguments. A micro batch records the config
it was planned with (``MicroBatch.config``), so later stages read CP size and layout from it::

    config = PlanConfig(seq_len=8, cp_size=2, cp_layout="zigzag")
    config.pad                                  # 4: every slot and row a multiple of 2 * cp_size
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Literal

from rollfeed.collate.balance import DEFAULT_QUADRATIC
from rollfeed.collate.cp import Layout, layout_unit
from rollfeed.collate.errors import BatchConfigError
from rollfeed.payload import PAYLOAD_FIELDS, PayloadField

Overlong = Literal["truncate", "drop", "error"]
OVERLONG: tuple[Overlong, ...] = ("truncate", "drop", "error")


def _int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BatchConfigError(f"PlanConfig.{name} must be an int >= 1, got {value!r}")
    return value


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanConfig:
    """How samples become micro batches; checked on construction (:class:`BatchConfigError`).

    Args:
        seq_len: tokens per micro batch row at most; a multiple of :attr:`pad`.
        cp_size: context-parallel ranks a row is split over (the ``cp`` axis); a loader's plan
            takes it from the rank's :class:`~rollfeed.collate.Topology` (``topology.bind``).
        cp_layout: ``"contiguous"`` (rank ``r`` holds chunk ``r`` of the row) or ``"zigzag"``
            (chunks ``r`` and ``2 * cp_size - 1 - r`` of every sample's slot, which balances
            causal attention; slots are padded to a multiple of ``2 * cp_size``).
        pad_to_multiple_of: a row's length is padded to a multiple of this; ``None``: the
            layout's unit, ``cp_size`` (contiguous) or ``2 * cp_size`` (zigzag). Must be a
            multiple of that unit.
        overlong: a sample longer than ``seq_len`` is cut to it (``"truncate"``, counted; the
            loader also warns once per step), left out (``"drop"``, counted) or refused
            (``"error"``, :class:`OverlongError`: pass it to make a truncation an error).
        quadratic_cost: weight of ``L**2`` in a sample's balance cost ``L + q * L**2`` (causal
            attention against per-token work); ``0`` balances tokens only.
        fields: the payload field registry samples are checked against and fields are read
            with (fill, window, ragged-ness); default the shared ``PAYLOAD_FIELDS``.
        trees: pack samples that claim a shared prefix (planned with
            :class:`~rollfeed.collate.SharedPrefixes`) as trees, the prefix computed once
            (:mod:`rollfeed.collate.prefix_trees`); ``False`` plans every sample flat.
        tree_min_saving: a tree is used only where it saves at least this fraction of its
            samples' tokens (in ``[0, 1]``).
    """

    seq_len: int
    cp_size: int = 1
    cp_layout: Layout = "contiguous"
    pad_to_multiple_of: int | None = None
    overlong: Overlong = "truncate"
    quadratic_cost: float = DEFAULT_QUADRATIC
    fields: Mapping[str, PayloadField] = field(default_factory=lambda: PAYLOAD_FIELDS, hash=False)
    trees: bool = True
    tree_min_saving: float = 0.2

    def __post_init__(self) -> None:
        _int("seq_len", self.seq_len)
        unit, pad, why = layout_unit(self.cp_size, self.cp_layout), self.pad_to_multiple_of, None
        cost = self.quadratic_cost
        number = isinstance(cost, int | float) and not isinstance(cost, bool)
        if self.overlong not in OVERLONG:
            why = f"overlong must be one of {OVERLONG}, got {self.overlong!r}"
        elif not (number and 0 <= cost < math.inf):
            why = f"quadratic_cost must be a finite number >= 0, got {cost!r}"
        elif not isinstance(self.trees, bool):
            why = f"trees must be a bool, got {self.trees!r}"
        elif not (
            isinstance(self.tree_min_saving, int | float)
            and not isinstance(self.tree_min_saving, bool)
            and 0 <= self.tree_min_saving <= 1
        ):
            why = f"tree_min_saving must be a number in [0, 1], got {self.tree_min_saving!r}"
        elif pad is not None and _int("pad_to_multiple_of", pad) % unit:
            why = f"pad_to_multiple_of must be a multiple of {unit} ({self.cp_layout}), got {pad}"
        elif self.seq_len % self.pad:
            why = f"seq_len={self.seq_len} is not a multiple of the pad multiple {self.pad} "
            why += f"({self.cp_layout}, cp_size={self.cp_size}); choose seq_len = k * {self.pad}"
        elif not isinstance(self.fields, Mapping) or not all(
            isinstance(k, str) and isinstance(v, PayloadField) for k, v in self.fields.items()
        ):
            why = "fields must map field names to PayloadField, e.g. PAYLOAD_FIELDS"
        if why is not None:
            raise BatchConfigError(f"PlanConfig.{why}")

    @property
    def pad(self) -> int:
        """Pad multiple of a row's length, and the length of a dummy micro batch."""
        if self.pad_to_multiple_of is None:
            return layout_unit(self.cp_size, self.cp_layout)
        return self.pad_to_multiple_of

    def differences(self, other: PlanConfig) -> list[str]:
        """``"name: mine != other's"`` for every option that differs (empty when equal)."""
        out = []
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if f.name == "fields" and mine != theirs:
                names = sorted(n for n in {*mine, *theirs} if mine.get(n) != theirs.get(n))
                out.append(f"fields differ at {names}")
            elif mine != theirs:
                out.append(f"{f.name}: {mine!r} != {theirs!r}")
        return out
