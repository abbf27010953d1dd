"""One resume check for every stateful object (the sampler, the loader with and without workers).

``check_resume(make, passes=P, ks=...)``: a fresh object from ``make()`` run for ``P`` passes (one
pass = one training step) is the reference stream. For each ``k``: a fresh object consumes ``k``
items (stopping mid-pass; when ``k`` ends a pass, running it to ``StopIteration`` if
``finish_passes``, else stopping right after its last item), its ``state_dict()`` goes
through JSON (a state is a few integers), a second fresh object loads it, and its items must be
exactly the reference's remainder — nothing lost, nothing repeated.

``key=tmb_key`` compares streams of ``TensorMicroBatch`` bitwise: every tensor it holds (each
tensor field and every entry of ``fields``) and every other attribute.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import torch

from rollfeed.payload import RaggedRows


def _tensor(t: torch.Tensor | RaggedRows) -> tuple:
    if isinstance(t, RaggedRows):  # a ragged field: its offsets, then its values
        return (*_tensor(t.offsets), *_tensor(t.values))
    return (t.dtype, tuple(t.shape), t.contiguous().numpy().tobytes())


def tmb_key(t: Any) -> tuple:
    """A ``TensorMicroBatch`` as comparable values: ``(name, dtype, shape, bytes)`` per tensor
    field and per ``fields`` and ``coverage`` entry (sorted by name), ``(name, repr)`` per other
    attribute (``seq_len``, the cp coordinates, ``checks``, ...)."""
    key: list[tuple] = []
    for f in dataclasses.fields(t):
        value = getattr(t, f.name)
        if f.name in ("fields", "coverage"):
            key += [(f"{f.name}[{k}]", *_tensor(v)) for k, v in sorted(value.items())]
        elif isinstance(value, torch.Tensor):
            key.append((f.name, *_tensor(value)))
        elif f.name == "media" and value is not None:
            key += [
                (f"media.{g.name}", *_tensor(getattr(value, g.name)))
                for g in dataclasses.fields(value)
            ]
        else:
            key.append((f.name, repr(value)))
    return tuple(key)


def _take(obj, k: int, cuts: list[int], finish: bool) -> None:
    got = 0
    while got < k:
        for _ in obj:
            got += 1
            if got == k and not (finish and k in cuts):
                break  # mid-pass: leave the iterator unfinished, as a trainer that stops does
        else:
            continue
        break


def check_resume(
    make: Callable[[], Any],
    *,
    passes: int,
    ks: list[int] | None = None,
    key: Callable[[Any], Any] = lambda x: x,
    finish_passes: bool = True,
) -> list[int]:
    """Run the check (see module doc); returns the pass boundaries of the reference."""
    ref: list[Any] = []
    cuts: list[int] = []
    obj = make()
    for _ in range(passes):
        ref += [key(x) for x in obj]
        cuts.append(len(ref))
    assert len(set(cuts)) == passes, f"a pass yielded nothing: {cuts}"
    for k in range(len(ref) + 1) if ks is None else ks:
        obj = make()
        _take(obj, k, cuts, finish_passes)
        state = json.loads(json.dumps(obj.state_dict()))
        fresh = make()
        fresh.load_state_dict(state)
        rest: list[Any] = []
        for _ in range(passes + 1):
            if len(rest) >= len(ref) - k:
                break
            rest += [key(x) for x in fresh]
        assert len(rest) == len(ref) - k, (k, len(rest), len(ref))
        assert rest == ref[k:], f"resume after {k} items (pass ends {cuts}) differs"
    return cuts
