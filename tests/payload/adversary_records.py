"""The records family: every field of real records (and their JSON) at boundary values, odd
types, paths out of the root, symlinks, a FIFO: typed refusal or the writer's exact rows."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from tests.payload.adversary_corpus import Corpus, build_corpus, packed
from tests.payload.adversary_oracle import FIELDS, check_read, read_case
from tests.payload.adversary_tally import Tally, Wrong

INTS = [0, -1, 1, 2, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**62 - 1, 2**62, 2**63 - 1, -(2**63)]
INTS += [2**64, 10**30]
JSON_ODD = [True, False, 1.0, 1.5, "1", None, [], {}, float("nan"), float("inf")]
ODD_FILES = [
    "", ".", "..", "/", "g", "g/", "g/a.rfp/", "g/a.rfp/x", "g//a.rfp", "g/./a.rfp",
    "g/../g/a.rfp", "../outside/g/a.rfp", "g\\a.rfp", "g/a.rfp\0", "g/a\0.rfp", "G/a.rfp",
    "g/missing.rfp", "g/b.rfp", "g/link.rfp", "g/up.rfp", "lnk/a.rfp", "g/fifo.rfp",
    "g/dir.rfp", "a" * 5000, "g/" + "b" * 300 + ".rfp", "~/g/a.rfp",
]  # fmt: skip
ODD_DTYPES = [
    "uint8", "int8", "uint16", "int16", "uint32", "int32", "int64", "float16", "float32",
    "float64", "bool", "complex64", "object", "<u1", ">i4", "int32\0", "", "V8", "U4", "f8",
    "uint24", "uint24\0", "int24",  # the 3-byte ragged value width, and near misses
]  # fmt: skip
ODD_SHAPES = [
    [], [0], [-1], [1], [6], [2, 3], [3, 2], [12], [2, 2], [2, 3, 1], [2**31], [2**24 - 1],
    [2**23], [2**62, 2**62], [1] * 64, [2**31, 2**31], [-2, -3], [1.5], [True, True],
]  # fmt: skip
INT_ATTRS = ("offset", "pos", "rows", "first")
LAYOUT_ATTRS = ("rows", "values", "count_bytes", "block_rows")


def record_mutations(seg, corpus: Corpus, canary: str):
    """``(level, description, mutate)``: ``mutate(dict)`` edits a record's JSON dict in place."""
    from rollfeed.payload import PayloadSegment

    others = sorted({off for (f, off) in corpus.regions if f == seg.file} - {seg.offset})
    muts = []

    def put(key, value, sub=None):
        def edit(d):
            if sub is None:
                d[key] = value
            elif d.get("ragged") is not None:
                d["ragged"][sub] = value

        return edit

    for attr in INT_ATTRS:
        v = getattr(seg, attr)
        vals = [*INTS, v - 1, v + 1, 2 * v]
        if attr == "offset":
            vals += [*others, v - 40 - len(seg.field), v + 8]
        for x in vals:
            muts.append(("py", f"{attr}={x}", put(attr, x)))
            muts.append(("json", f"{attr}={x}", put(attr, x)))
        for x in JSON_ODD:
            muts.append(("json", f"{attr}={x!r}", put(attr, x)))
    for x in [*ODD_FILES, canary]:
        muts.append(("json", f"file={x[:60]!r}", put("file", x)))
    for x in ODD_DTYPES:
        muts.append(("json", f"dtype={x!r}", put("dtype", x)))
    for x in [*FIELDS, "", "unknown", "sampling_mask\0", 5]:
        muts.append(("json", f"field={x!r}", put("field", x)))
    for x in [*ODD_SHAPES, "x", None, 6]:
        muts.append(("json", f"shape={x!r}", put("shape", x)))
    lay = {"rows": 3, "values": 4, "count_bytes": 1, "block_rows": 128}
    for x in [None, {}, lay, {**lay, "extra": 1}, [], 5]:
        muts.append(("json", f"ragged={x!r}", put("ragged", x)))
    if seg.ragged is not None:
        for sub in LAYOUT_ATTRS:
            v = getattr(seg.ragged, sub)
            for x in [*INTS, v - 1, v + 1, 3, 4, 8, 127, 129]:
                muts.append(("py", f"ragged.{sub}={x}", put(None, x, sub)))
                muts.append(("json", f"ragged.{sub}={x}", put(None, x, sub)))
            for x in JSON_ODD[:5]:
                muts.append(("json", f"ragged.{sub}={x!r}", put(None, x, sub)))
    known = {*INT_ATTRS, "field", "file", "dtype", "shape", "ragged"}
    for attr in set(PayloadSegment.model_fields) - known:  # e.g. a file id
        v = getattr(seg, attr)
        for x in [None, 0, -1, 1, 2**63 - 1, 2**64, "", "0" * 32, "x", True, 1.5, v]:
            muts.append(("json", f"{attr}={x!r}", put(attr, x)))
    return muts


def mutated_segment(victim, level: str, edit):
    """``victim`` (a PayloadSegment) with ``edit`` applied to its JSON: built past validation
    (``"py"``: what code handing the reader a constructed record could do) or parsed from the
    edited JSON (what an orchestrator's wire could carry), where a JSON bool accepted as an
    integer is a finding."""
    from rollfeed.payload import PayloadSegment, RaggedLayout

    d = json.loads(victim.model_dump_json())
    edit(d)
    if level == "py":
        lay = d.pop("ragged")
        upd = {k: v for k, v in d.items() if v != getattr(victim, k)}
        if lay is not None and victim.ragged is not None:
            upd["ragged"] = RaggedLayout.model_construct(**lay)
        return victim.model_copy(update=upd)
    seg = PayloadSegment.from_json(json.dumps(d))
    if _json_bool_in_int(d, victim):
        raise Wrong(f"from_json accepted a JSON bool as an integer: {seg}")
    return seg


def _json_bool_in_int(d: dict, seg) -> bool:
    ints = [d.get(a) for a in INT_ATTRS]
    if isinstance(d.get("ragged"), dict):
        ints += [d["ragged"].get(a) for a in LAYOUT_ATTRS]
    return any(isinstance(x, bool) for x in ints)


def family_records(tally: Tally, workdir: Path, rng: np.random.Generator) -> None:
    from rollfeed.payload import (
        PayloadRoot,
        clip_segments,
        read_field,
    )

    corpus = build_corpus(workdir, rng)
    root = PayloadRoot(corpus.root, retries=0)
    canary = os.fspath(corpus.outside / "g" / "a.rfp")
    batches = [packed(corpus, [0, 1]), packed(corpus, [5, 3, 4, 6])]
    segs, total = packed(corpus, [1, 7])
    batches.append((clip_segments(segs, 50, 260), total))
    for segs, total in batches:
        windows = [[(0, total + 3)], [(3, min(total, 140)), (total // 2, total)]]
        for name in FIELDS:
            for w in windows:
                read_case(
                    tally, f"records: unmodified {name} {w}", segs, name, w, root, corpus.regions
                )
    for b, (segs, total) in enumerate(batches):
        windows = [[(0, total + 3)], [(3, min(total, 140)), (total // 2, total)]]
        live = [s for s in segs if s.rows]
        picks = [
            rng.choice([s for s in live if s.ragged is None]),
            rng.choice([s for s in live if s.ragged is not None]),
        ]
        for k, victim in enumerate(picks):
            at = segs.index(victim)
            for j, (level, what, edit) in enumerate(record_mutations(victim, corpus, canary)):
                w = windows[(j + k) % 2]
                desc = f"records[{b}] {level} {what} on {victim.model_dump_json()} window {w}"

                def attack(level=level, edit=edit, w=w, victim=victim, at=at, segs=segs):
                    seg = mutated_segment(victim, level, edit)
                    mutated = [*segs[:at], seg, *segs[at + 1 :]]
                    for name in {victim.field, seg.field} & set(FIELDS):
                        out = read_field(mutated, name, w, root=root)
                        check_read(out, mutated, name, w, corpus.regions)

                tally.case(desc, attack)
