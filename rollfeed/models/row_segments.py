"""Segments: the pieces of a packed row that attend only within themselves (its samples, or
their chunks under chunked attention), as the attention and linear-attention kernels take them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True, slots=True)
class Segments:
    """The pieces of a packed row that attend only within themselves, canonical order.

    ``bounds``: strictly increasing from 0 to ``S`` (empty pieces dropped). ``groups``:
    ``(length, starts)`` per distinct length, the pieces one batched SDPA call covers.
    ``cu_seqlens [B+1]`` int32: ``bounds`` on the row's device, for kernels that take the
    boundaries as a tensor (varlen attention, the linear-attention kernels).

    Example: bounds (0, 3, 5, 7) -> groups ((2, (3, 5)), (3, (0,))), cu_seqlens [0, 3, 5, 7].
    """

    bounds: tuple[int, ...]
    groups: tuple[tuple[int, tuple[int, ...]], ...]
    cu_seqlens: torch.Tensor

    @property
    def max_length(self) -> int:
        return self.groups[-1][0] if self.groups else 0


def make_segments(lengths: list[int], device: torch.device) -> Segments:
    """:class:`Segments` of pieces of ``lengths`` (all > 0) laid end to end."""
    bounds = [0]
    by_length: dict[int, list[int]] = {}
    for n in lengths:
        by_length.setdefault(n, []).append(bounds[-1])
        bounds.append(bounds[-1] + n)
    return Segments(
        bounds=tuple(bounds),
        groups=tuple((n, tuple(starts)) for n, starts in sorted(by_length.items())),
        cu_seqlens=_to_device(bounds, device),
    )


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    host = torch.tensor(values, dtype=torch.int32, device="cpu")
    if device.type == "cuda":  # a pinned, non-blocking copy: no host sync per forward
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
