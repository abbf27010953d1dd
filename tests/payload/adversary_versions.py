"""The versions family: a file replaced under its name in sequences of versions, read through
its old records after every step, on an object-store root (objects overwritten under their key)
and on a local one (files renamed over).

A version is the records' own file, a copy of it cut short (the same header and file id),
another writer's valid file of the same layout (another file id), a cut copy of that one, or
nothing (deleted). Every sequence ``ours -> A -> B -> ours`` is run (:func:`sequences`: ``A`` a
version a read refuses, ``B`` one after it); after each step the old records are read by roots
that keep what they saw before (one plain, one checking every block's CRC-32C) and, on the local
root, by a fresh one, each field in turn read first. Every read is the records' own rows or a
typed refusal: never the other writer's rows, whatever a root cached of an earlier version (a
header, a size, an ETag).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from tests.payload.adversary_corpus import kept_sets, request_arrays
from tests.payload.adversary_oracle import FIELDS, SAMPLED, check_read, write_request
from tests.payload.adversary_tally import Tally

READS = {"s3": 1, "local": 4}  # fields read after each step (the first one rotates)


def _cuts(raw: bytes, regions: dict) -> list[int]:
    """Cut points: inside the file header and the first region's header, the middle of every
    region's body (a read of that field is refused: the file is too short for it), one byte
    short (a checking read's last checksum)."""
    mids = {r.offset + r.body_bytes // 2 for r in regions.values() if r.rows}
    return sorted({10, 70, len(raw) - 1} | mids)


def sequences(cuts: list[int], *, every: bool) -> list[list[tuple[str, int]]]:
    """Every ``ours -> A -> B -> ours`` with ``A`` a version a read refuses or must refuse (a cut
    copy at each cut, deleted, another writer's file) and ``B`` one that follows it (another
    writer's file, whole or cut mid-way, or ours again): ``(kind, cut)`` steps after the first.
    ``every=False`` (the object store, where each step costs requests): the cuts a read refuses
    (headers, the middle of a body) then another writer's file or ours."""
    if every:
        firsts = [("cut", k) for k in cuts] + [("gone", 0), ("theirs", 0)]
        thens = [("theirs", 0), ("theirs_cut", cuts[len(cuts) // 2]), ("ours", 0)]
    else:
        firsts = [("cut", k) for k in cuts[1:-1]] + [("gone", 0)]
        thens = [("theirs", 0), ("ours", 0)]
    return [[a, b, ("ours", 0)] for a in firsts for b in thens]


def _version(step: tuple[str, int], ours: bytes, theirs: bytes):
    """``(description, bytes or None for deleted)``."""
    kind, cut = step
    if kind == "ours":
        return "ours", ours
    if kind == "gone":
        return "deleted", None
    if kind == "theirs":
        return "another writer's file", theirs
    whole = ours if kind == "cut" else theirs
    return f"{'ours' if kind == 'cut' else 'theirs'} cut at {cut} of {len(whole)}", whole[:cut]


def _write_pair(rng, root_ours, root_theirs, rows: int):
    """The records' request (``root_ours``) and another writer's of the same layout (the same
    kept-set sizes and stored widths, so every record lines up with a region there), other
    values."""
    from rollfeed.payload import PayloadWriter

    arrays = request_arrays(rng, rows)
    counts = arrays["sampling_mask"][0]
    ids, sampled = kept_sets(rng, counts)
    theirs = {
        "routed_experts": rng.integers(1, 200, (rows, 2, 3)),
        "routed_expert_weights": rng.normal(size=(rows, 2, 3)).astype(
            arrays["routed_expert_weights"].dtype
        ),
        "sampling_mask": (counts, ids),
        "sampling_mask_logprobs": (counts, (-9 * rng.random(len(ids))).astype(np.float32)),
        SAMPLED: sampled,
    }
    regions: dict = {}
    with PayloadWriter(root_ours, group="g", name="w") as w:
        segs = write_request(w, arrays, regions)
    with PayloadWriter(root_theirs, group="g", name="w") as w:
        other = write_request(w, theirs, {})
    assert [s.offset for s in other] == [s.offset for s in segs]  # the same layout
    return segs, regions


def _sequences(tally: Tally, rng, kind: str, segs, regions, ours, theirs, place, roots) -> None:
    """Run every sequence of :func:`sequences`; ``place(j, data)`` puts a version for sequence
    ``j``, ``roots(j)`` gives its ``(label, root, fresh)`` readers."""
    from rollfeed.payload import read_field

    total = segs[0].rows
    for j, seq in enumerate(sequences(_cuts(ours, regions), every=kind == "local")):
        place(j, ours)
        readers = roots(j)
        for _, root, fresh in readers:  # each root sees the records' own file first
            if not fresh:
                read_field(segs, "routed_experts", (0, total), root=root)
        history = ["ours"]
        for step, version in enumerate(seq):
            what, data = _version(version, ours, theirs)
            place(j, data)
            history.append(what)
            # each field in turn is the first read after a replacement: what a root cached of a
            # refused version is then all it has to go on
            order = np.roll(FIELDS, -(j + step)).tolist()[: READS[kind]]
            for name in order:
                w = [(0, total + 1)] if (j + step) % 2 else [(1, total // 2), (total - 3, total)]
                for label, root, fresh in readers:
                    if fresh:
                        root.close()

                    def attack(name=name, w=w, root=root):
                        check_read(read_field(segs, name, w, root=root), segs, name, w, regions)

                    path = " -> ".join(history)
                    tally.case(f"versions {kind} seq {j}: {path}; {label} reads {name} {w}", attack)


def family_versions(tally: Tally, workdir: Path, rng: np.random.Generator) -> None:
    """Replace / truncate / restore sequences, read through old records (see the module doc)."""
    _local(tally, workdir, rng)
    if os.environ.get("AWS_ENDPOINT_URL"):  # the session's S3 server, passed on by the test
        _objects(tally, rng)


def _local(tally: Tally, workdir: Path, rng: np.random.Generator) -> None:
    from rollfeed.payload import PayloadRoot

    segs, regions = _write_pair(rng, workdir / "ours", workdir / "theirs", 150)
    ours = (workdir / "ours" / segs[0].file).read_bytes()
    theirs = (workdir / "theirs" / segs[0].file).read_bytes()
    made: dict[int, list] = {}

    def place(j: int, data: bytes | None) -> None:
        path = workdir / f"seq{j}" / segs[0].file
        path.parent.mkdir(parents=True, exist_ok=True)
        if data is None:
            path.unlink(missing_ok=True)
            return
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # renamed over: a reader holding the old one keeps its bytes

    def roots(j: int):
        if j not in made:
            d = workdir / f"seq{j}"
            made[j] = [
                ("cached", PayloadRoot(d, retries=0), False),
                ("cached checking", PayloadRoot(d, retries=0, verify_checksums=True), False),
                ("fresh", PayloadRoot(d, retries=0), True),
            ]
        return made[j]

    _sequences(tally, rng, "local", segs, regions, ours, theirs, place, roots)


def _objects(tally: Tally, rng: np.random.Generator) -> None:
    import obstore

    from rollfeed.payload import PayloadRoot
    from tests.object_store_server import BUCKET

    base = f"s3://{BUCKET}/adversary-versions-{os.getpid()}-{int(rng.integers(1 << 30))}"
    segs, regions = _write_pair(
        rng, PayloadRoot(f"{base}/ours"), PayloadRoot(f"{base}/theirs"), 150
    )
    probe = PayloadRoot(base, retries=0)
    store = probe.store.client.process().store
    ours = bytes(obstore.get(store, probe.store.url.key(f"ours/{segs[0].file}")).bytes())
    theirs = bytes(obstore.get(store, probe.store.url.key(f"theirs/{segs[0].file}")).bytes())

    def place(j: int, data: bytes | None) -> None:
        key = probe.store.url.key(f"seq{j}/{segs[0].file}")
        if data is None:
            obstore.delete(store, key)
        else:
            obstore.put(store, key, data)  # overwritten under its key: a new ETag

    made: dict[int, list] = {}

    def roots(j: int):
        if j not in made:
            url = f"{base}/seq{j}"  # roots that cache what they saw: the attack's target
            made[j] = [
                ("cached", PayloadRoot(url, retries=0), False),
                ("cached checking", PayloadRoot(url, retries=0, verify_checksums=True), False),
            ]
        return made[j]

    _sequences(tally, rng, "s3", segs, regions, ours, theirs, place, roots)
