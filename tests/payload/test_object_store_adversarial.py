"""The adversarial byte and truncation families (:mod:`tests.payload.adversary`) against an
object-store root, at lower counts: a mutated or cut object is uploaded under its own prefix and
every read of it is either a typed ``rollfeed`` error or exactly the writer's rows, never a hang,
never other data. Records pointing outside the prefix are refused before any request."""

import numpy as np
import pytest

from rollfeed.payload import PayloadPathError, PayloadRoot, read_field
from rollfeed.payload.format import layout
from tests.payload.adversary import format_summary
from tests.payload.adversary_corpus import byte_mutations, small_file
from tests.payload.adversary_oracle import FIELDS, check_read
from tests.payload.adversary_tally import FAILURES, Tally

CASES = 40  # mutations (or cuts) per family; the local families run all of theirs


def _put(server, url: str, data: bytes) -> None:
    import obstore

    root = PayloadRoot(url, **server.options())
    obstore.put(root._proc().store, root.url.key("f.rfp"), data)


def _holds(tally: Tally, least: int) -> None:
    s = tally.summary()
    print(format_summary(s))
    assert all(s[k] == 0 for k in FAILURES), s["examples"]
    assert s["tried"] >= least and s["correct"] and s["refused"], s


def test_mutated_objects_read_exactly_or_fail_typed(tmp_path, object_store, s3_url):
    rng = np.random.default_rng(21)
    segs, regions, total, raw, _ = small_file(tmp_path, rng, (5, 140, 0, 3))
    muts = byte_mutations(raw, regions, rng)
    picks = rng.choice(len(muts), size=min(CASES, len(muts)), replace=False)
    tally = Tally("bytes-s3", tmp_path, trace=False)
    windows = [[(0, total + 2)], [(60, 150)], [(130, 134), (0, 2)]]
    for j in sorted(picks.tolist()):
        what, at, new = muts[j]
        mutated = bytearray(raw)
        mutated[at : at + len(new)] = new
        url = f"{s3_url}/c{j}"
        _put(object_store, url, bytes(mutated))
        root = PayloadRoot(url, **object_store.options(retries=0, verify_checksums=True))
        for name in FIELDS:
            w = windows[(j + FIELDS.index(name)) % len(windows)]

            def attack(name=name, w=w, root=root):
                check_read(read_field(segs, name, w, root=root), segs, name, w, regions)

            tally.case(f"bytes-s3: {what}, read {name} {w}", attack)
    _holds(tally, CASES * len(FIELDS))


def test_objects_cut_short_read_exactly_or_fail_typed(tmp_path, object_store, s3_url):
    rng = np.random.default_rng(22)
    segs, regions, total, raw, _ = small_file(tmp_path, rng, (3, 2))
    bounds = {layout.FILE_HEADER.size} | {r.end for r in regions.values()}
    near = {b + d for b in bounds for d in (-1, 0, 1) if 0 <= b + d < len(raw)}
    spread = set(np.linspace(0, len(raw) - 1, CASES - len(near), dtype=int).tolist())
    tally = Tally("truncation-s3", tmp_path, trace=False)
    for cut in sorted(near | spread):
        url = f"{s3_url}/c{cut}"
        _put(object_store, url, raw[:cut])
        root = PayloadRoot(url, **object_store.options(retries=0))
        for name in FIELDS:
            w = [(0, total + 1)]

            def attack(name=name, w=w, root=root):
                check_read(read_field(segs, name, w, root=root), segs, name, w, regions)

            tally.case(f"truncation-s3: cut at {cut} of {len(raw)}, read {name}", attack)
    _holds(tally, len(near | spread) * len(FIELDS))


@pytest.mark.parametrize("handle", ["../x/f.rfp", "/f.rfp", "a/../../f.rfp", "a//f.rfp", "a\\f"])
def test_records_naming_keys_outside_the_prefix_are_refused(tmp_path, object_store, s3_url, handle):
    rng = np.random.default_rng(23)
    segs, _, total, raw, _ = small_file(tmp_path, rng, (4,))
    _put(object_store, f"{s3_url}/outside", raw)  # what an escaping handle would reach
    moved = [s.model_copy(update={"file": handle}) for s in segs]
    root = PayloadRoot(f"{s3_url}/root", **object_store.options())
    with pytest.raises(PayloadPathError):
        read_field(moved, "routed_experts", (0, total), root=root)


def test_mutated_records_read_exactly_or_fail_typed(tmp_path, object_store, s3_url):
    from types import SimpleNamespace

    from tests.payload.adversary_records import mutated_segment, record_mutations

    rng = np.random.default_rng(24)
    segs, regions, total, raw, _ = small_file(tmp_path, rng, (5, 140, 3))
    _put(object_store, f"{s3_url}/root", raw)
    _put(object_store, f"{s3_url}/outside", raw)  # the canary an escaping handle would reach
    root = PayloadRoot(f"{s3_url}/root", **object_store.options(retries=0))
    corpus = SimpleNamespace(regions=regions)
    tally = Tally("records-s3", tmp_path, trace=False)
    windows = [[(0, total + 3)], [(3, min(total, 140)), (total // 2, total)]]
    live = [s for s in segs if s.rows]
    victims = [
        next(s for s in live if s.ragged is None),
        next(s for s in live if s.ragged is not None),
    ]
    for k, victim in enumerate(victims):
        at = segs.index(victim)
        muts = record_mutations(victim, corpus, "../outside/f.rfp")
        picks = rng.choice(len(muts), size=min(3 * CASES, len(muts)), replace=False)
        for j in sorted(picks.tolist()):
            level, what, edit = muts[j]
            w = windows[(j + k) % 2]

            def attack(level=level, edit=edit, w=w, victim=victim, at=at):
                seg = mutated_segment(victim, level, edit)
                mutated = [*segs[:at], seg, *segs[at + 1 :]]
                for name in {victim.field, seg.field} & set(FIELDS):
                    check_read(read_field(mutated, name, w, root=root), mutated, name, w, regions)

            tally.case(f"records-s3 {level} {what} on {victim.field} window {w}", attack)
    _holds(tally, 2 * CASES)
