"""A writer whose file is gone (its group pruned, the file replaced at its path, or removed while
it is written) writes to a fresh file: every record it hands out names bytes a reader reaches."""

import os
import shutil

import numpy as np
import pytest

from rollfeed.payload import PayloadMissingFileError, PayloadRoot, PayloadWriter, read_field


def experts(rows: int, value: int) -> dict:
    return {"routed_experts": np.full((rows, 2), value, np.int64)}


def read_back(segs, root, rows: int) -> np.ndarray:
    return read_field(segs, "routed_experts", (0, rows), root=PayloadRoot(root)).numpy()


def test_a_write_after_its_group_was_pruned_goes_to_a_fresh_readable_file(tmp_path):
    with PayloadWriter(tmp_path, group="step_000001", name="w0") as w:
        first = w.write(experts(4, 1), pos=0)
        PayloadRoot(tmp_path).prune("step_000001")
        second = w.write(experts(3, 2), pos=0)
        third = w.write(experts(2, 3), pos=0)
    assert (read_back(second, tmp_path, 3) == 2).all()
    assert (read_back(third, tmp_path, 2) == 3).all()
    with pytest.raises(PayloadMissingFileError):  # the pruned record stays pruned
        read_back(first, tmp_path, 4)
    assert first[0].file == "step_000001/w0.rfp"
    assert second[0].file == third[0].file == "step_000001/w0-1.rfp"
    assert second[0].file_id != first[0].file_id and w.restarts == 1


def test_a_write_after_its_file_was_replaced_never_names_the_other_file(tmp_path):
    with PayloadWriter(tmp_path, group="g", name="other") as other:
        theirs = other.write(experts(3, 9), pos=0)
    path = tmp_path / "g" / "w0.rfp"
    with PayloadWriter(tmp_path, group="g", name="w0") as w:
        w.write(experts(3, 1), pos=0)
        os.rename(path, tmp_path / "g" / "moved.rfp")
        shutil.copyfile(tmp_path / theirs[0].file, path)  # another writer's file at w0's path
        before = path.read_bytes()
        mine = w.write(experts(3, 2), pos=0)
    assert (read_back(mine, tmp_path, 3) == 2).all()
    assert mine[0].file == "g/w0-1.rfp"
    assert path.read_bytes() == before  # the file now at the old path is not written to


def test_a_file_pruned_while_it_is_written_is_written_again_to_a_fresh_file(tmp_path, monkeypatch):
    fsync, pruned = os.fsync, []

    def prune_during_the_write(fd):
        fsync(fd)
        if not pruned:  # the group goes after the bytes were written, before records return
            pruned.append(True)
            PayloadRoot(tmp_path).prune("g")

    with PayloadWriter(tmp_path, group="g", name="w0", fsync="always") as w:
        monkeypatch.setattr(os, "fsync", prune_during_the_write)
        segs = w.write(experts(5, 7), pos=0)
    assert pruned and (read_back(segs, tmp_path, 5) == 7).all()
    assert segs[0].file == "g/w0-1.rfp"


def test_an_object_store_writer_after_a_prune_writes_readable_objects(object_store, s3_url):
    root = PayloadRoot(s3_url, **object_store.options())
    with PayloadWriter(root, group="g", name="w0") as w:
        w.write(experts(4, 1), pos=0)
        root.prune("g")
        segs = w.write(experts(3, 2), pos=0)
    assert segs[0].file == "g/w0-000002.rfp"
    got = read_field(
        segs, "routed_experts", (0, 3), root=PayloadRoot(s3_url, **object_store.options())
    )
    assert (got.numpy() == 2).all()
