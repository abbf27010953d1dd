"""The bounds family: outputs far larger than their files (one wide row read over a long
window), against the read's output bound (the root's ``max_output_bytes``).

Files hold a kept set of ``W`` ids in one row (1 .. 500,000: up to 1.5 MB of file) or fixed rows
of up to 1 MiB each; each is read over windows of 1 .. 2**20 rows, with bounds from 1 KiB to the
default 1 GiB, a static ``width`` or none, by the compiled read and by the planned reader (a
checking root). The oracle knows the output's size: past the bound the read must raise
``PayloadOutputBoundError`` (a read that returns is wrong), within it the read must be exact (a
refusal for the bound is wrong; a row wider than ``width`` is a typed refusal). Every case runs
under the traced allocation bound (64 MiB) and the family's 1 GiB address space, so a refusal
that allocates first is an overalloc; the bounds are chosen so an exact read stays below it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.payload.adversary_corpus import kept_sets
from tests.payload.adversary_oracle import SAMPLED, check_read, write_request
from tests.payload.adversary_tally import ALLOC_BOUND, Tally, Wrong

WIDE = (1, 2, 255, 256, 3000, 50_000, 500_000)  # the widest kept set of a file
ROW_BYTES = (6, 4096, 1 << 20)  # fixed rows of (1, n) uint8 routing ids
WINDOWS = (1, 7, 16_384, 1 << 20)
BOUNDS = (1 << 10, 64 << 10, 4 << 20, 1 << 30)
WIDTHS = (None, 300)


def _files(workdir: Path, rng: np.random.Generator):
    """``(label, root, segs, regions, fields)`` per file: ``fields[name]`` the values per output
    row, their bytes and a ragged field's row lengths (``W`` its widest, the label's slot
    included)."""
    from rollfeed.payload import PayloadWriter

    out = []
    for wide in WIDE:
        counts = np.array([1, wide, 2, 1], np.int64)
        ids, sampled = kept_sets(rng, counts)
        arrays = {"sampling_mask": (counts, ids), SAMPLED: sampled}
        regions: dict = {}
        base = workdir / f"mask{wide}"
        with PayloadWriter(base, group="g", name="w") as w:
            segs = write_request(w, arrays, regions)
        W = int(counts.max())  # the sampled token's column included
        fields = {"sampling_mask": (W, 4, counts)}
        out.append((f"a kept set of {wide}", base, segs, regions, fields))
    for row in ROW_BYTES:
        rows = rng.integers(1, 200, (3, 1, row))
        counts = np.ones(3, np.int64)
        ids, sampled = kept_sets(rng, counts)
        arrays = {"routed_experts": rows, "sampling_mask": (counts, ids), SAMPLED: sampled}
        regions = {}
        base = workdir / f"rows{row}"
        with PayloadWriter(base, group="g", name="w") as w:
            segs = write_request(w, arrays, regions)
        fields = {"routed_experts": (row, 1, None)}
        out.append((f"rows of {row} bytes", base, segs, regions, fields))
    return out


def family_bounds(tally: Tally, workdir: Path, rng: np.random.Generator) -> None:
    """Every file over every window, bound, width and read path (see the module doc)."""
    from rollfeed.payload import (
        PayloadOutputBoundError,
        PayloadRoot,
        PayloadWidthError,
        read_field,
    )

    for label, base, segs, regions, fields in _files(workdir, rng):
        for name, (values, itemsize, counts) in fields.items():
            for n in WINDOWS:
                for bound in BOUNDS:
                    for width in WIDTHS if name == "sampling_mask" else (None,):
                        if counts is None:
                            size = n * values * itemsize
                        elif width is None:  # ragged: offsets, and the window's values
                            size = 8 * (n + 1) + itemsize * int(counts[:n].sum())
                        else:
                            size = n * width * itemsize
                        padded = n * (values if width is None else width) * itemsize
                        if bound >= size and padded > ALLOC_BOUND // 16:
                            continue  # a legitimate read this large: the oracle's padded copies
                            # of it (several times its size) would pass the allocation bound
                        for checked in (False, True):
                            root = PayloadRoot(
                                base, retries=0, max_output_bytes=bound, verify_checksums=checked
                            )

                            def attack(
                                name=name,
                                n=n,
                                width=width,
                                size=size,
                                bound=bound,
                                root=root,
                                segs=segs,
                                regions=regions,
                                values=values,
                            ):
                                w = [(0, n)]
                                try:
                                    out = read_field(segs, name, w, root=root, width=width)
                                except PayloadOutputBoundError:
                                    if size <= bound:
                                        raise Wrong(
                                            f"refused {size} bytes within the bound {bound}"
                                        ) from None
                                    raise
                                except PayloadWidthError:
                                    if width is None or values <= width:
                                        raise Wrong("a width refusal for rows within it") from None
                                    raise
                                if size > bound:
                                    raise Wrong(f"read {size} bytes past the bound {bound}")
                                check_read(out, segs, name, w, regions)

                            path = "planned" if checked else "compiled"
                            desc = (
                                f"bounds: {label}, {name} over {n} rows, width={width}, "
                                f"max_output_bytes={bound} ({size} bytes), {path}"
                            )
                            tally.case(desc, attack)
