"""The file families: flipped bytes (``bytes``), a file cut at every byte (``truncation``) and
size claims beyond a file of a few KiB (``memory``)."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from tests.payload.adversary_corpus import byte_mutations, small_file, struct_fields
from tests.payload.adversary_oracle import FIELDS, check_read, verify_case
from tests.payload.adversary_tally import Tally


def family_bytes(tally: Tally, workdir: Path, rng: np.random.Generator) -> None:
    """Every checking read (``verify_checksums=True``) of a mutated file is a typed error or the
    writer's exact arrays, whichever bytes changed (headers, CSR index, padding, values, checksum
    tables): a flipped value byte the read covers is a ``PayloadChecksumError``, never new data.
    ``verify`` names the file for every one of them."""
    from rollfeed.payload import PayloadRoot, read_field

    base = workdir / "base"
    segs, regions, total, raw, kind = small_file(base, rng, (5, 140, 0, 3))
    windows = [[(0, total + 2)], [(60, 150)], [(130, 134), (0, 2)]]
    for j, (what, at, new) in enumerate(byte_mutations(raw, regions, rng)):
        mutated = bytearray(raw)
        mutated[at : at + len(new)] = new
        d = workdir / f"c{j}"
        d.mkdir()
        (d / "f.rfp").write_bytes(bytes(mutated))
        changed = sorted({str(kind[i]) for i in range(at, at + len(new)) if raw[i] != mutated[i]})
        root = PayloadRoot(d, retries=0, verify_checksums=True)
        for name in FIELDS:
            w = windows[(j + FIELDS.index(name)) % len(windows)]

            def attack(name=name, w=w, root=root):
                check_read(read_field(segs, name, w, root=root), segs, name, w, regions)

            tally.case(f"bytes: {what} ({'/'.join(changed)}), read {name} {w}", attack)
        verify_case(tally, f"bytes: {what}, verify", d, flag="f.rfp")
        root.close()


def family_truncation(tally: Tally, workdir: Path, rng: np.random.Generator) -> None:
    """A file cut at every byte: reads are exact or typed; verify and inspect flag every cut
    that is not a region boundary."""
    from rollfeed.payload import PayloadRoot, read_field
    from rollfeed.payload.format import layout

    base = workdir / "base"
    segs, regions, total, raw, _ = small_file(base, rng, (3, 2))
    bounds = {len(raw), layout.FILE_HEADER.size} | {r.end for r in regions.values()}
    for cut in range(len(raw)):
        d = workdir / f"c{cut}"
        d.mkdir()
        (d / "f.rfp").write_bytes(raw[:cut])
        root = PayloadRoot(d, retries=0)
        for name in FIELDS:
            w = [(0, total + 1)]

            def attack(name=name, w=w, root=root):
                check_read(read_field(segs, name, w, root=root), segs, name, w, regions)

            tally.case(f"truncation: cut at {cut} of {len(raw)}, read {name}", attack)
        flag = None if cut in bounds else "f.rfp"
        verify_case(tally, f"truncation: cut at {cut}, verify", d, flag=flag)
        verify_case(tally, f"truncation: cut at {cut}, inspect", d, flag=flag, command="inspect")
        root.close()


def family_memory(tally: Tally, workdir: Path, rng: np.random.Generator) -> None:
    """Records and headers claiming sizes beyond a file of a few KiB: typed refusals, never an
    allocation beyond ``ALLOC_BOUND``; ``verify`` of such files too."""
    from rollfeed.payload import PayloadRoot, read_field
    from rollfeed.payload.format import layout

    base = workdir / "base"
    segs, regions, _, raw, _ = small_file(base, rng, (3, 130))
    root = PayloadRoot(base, retries=0)
    fixed = next(s for s in segs if s.field == "routed_experts" and s.rows)
    weights = next(s for s in segs if s.field == "routed_expert_weights" and s.rows)
    ragged = next(s for s in segs if s.field == "sampling_mask" and s.rows == 130)
    claims = []
    for shape in ([2**24 - 1], [2**23], [2**20], [2**16, 2**7], [2**12] * 2, [1 << 22, 1]):
        for rows in (0, 1):
            claims.append(
                (
                    f"fixed rows={rows} shape={shape} float64",
                    [
                        weights.model_copy(
                            update={"rows": rows, "shape": tuple(shape), "dtype": "float64"}
                        )
                    ],
                )
            )
            claims.append(
                (
                    f"fixed rows={rows} shape={shape} uint8",
                    [fixed.model_copy(update={"rows": rows, "shape": tuple(shape)})],
                )
            )
    for rows in (2**20, 2**26, 2**31, 2**40, 2**62 - 1):
        claims.append((f"fixed rows={rows}", [fixed.model_copy(update={"rows": rows})]))
    for sub, values in (("values", (2**20, 2**26, 2**28, 2**31)), ("rows", (2**20, 2**26, 2**31))):
        for x in values:
            lay = ragged.ragged.model_copy(update={sub: x})
            upd = {"ragged": lay}
            if sub == "rows":
                upd["rows"] = x
            claims.append((f"ragged layout {sub}={x}", [ragged.model_copy(update=upd)]))
    lay = ragged.ragged.model_copy(update={"block_rows": 1 << 30})
    claims.append(("ragged block_rows=2**30", [ragged.model_copy(update={"ragged": lay})]))
    for what, claim in claims:
        for w in ([(0, 64)], [(0, 3)]):
            name = claim[0].field
            tally.case(
                f"memory: {what} window {w}",
                lambda c=claim, name=name, w=w: check_read(
                    read_field(c, name, w, root=root), c, name, w, regions
                ),
            )
    # headers that claim as much as the records do, so a record-vs-header check alone passes
    rh = dict(struct_fields(layout.REGION_HEADER))
    names = [
        "magic",
        "kind",
        "count_bytes",
        "dtype",
        "name_len",
        "block_rows",
        "rows",
        "values",
        "body_bytes",
    ]
    at = dict(zip(names, sorted(rh), strict=False))
    head = ragged.offset - layout.REGION_HEADER.size - len(ragged.field)
    for rows, values, block in ((1, 2**28, 128), (2**26, 0, 128), (130, 2**31, 128), (130, 4, 1)):
        blob = bytearray(raw)
        for key, x in (("rows", rows), ("values", values), ("block_rows", block)):
            code = rh[at[key]]
            blob[head + at[key] : head + at[key] + struct.calcsize("<" + code)] = struct.pack(
                "<" + code, x
            )
        d = workdir / f"h{rows}_{values}_{block}"
        d.mkdir()
        (d / "f.rfp").write_bytes(bytes(blob))
        lay = ragged.ragged.model_copy(update={"rows": rows, "values": values, "block_rows": block})
        claim = [ragged.model_copy(update={"rows": min(rows, 130), "ragged": lay})]
        r = PayloadRoot(d, retries=0)
        tally.case(
            f"memory: header and record claim rows={rows} values={values} block={block}",
            lambda c=claim, r=r: check_read(
                read_field(c, "sampling_mask", (0, 64), root=r),
                c,
                "sampling_mask",
                [(0, 64)],
                regions,
            ),
        )
        verify_case(
            tally,
            f"memory: verify header rows={rows} values={values} block={block}",
            d,
            flag="f.rfp",
        )
