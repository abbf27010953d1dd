"""A record read after its file was replaced under its name (an object overwritten on an
``s3://`` root, a file renamed over on a local one): the record's own rows or a typed refusal,
never the replacement's rows, whatever the reader saw of earlier versions (a cut copy that was
refused, a header cached from it)."""

import os

import numpy as np
import pytest

from rollfeed.payload import (
    PayloadError,
    PayloadRoot,
    PayloadStaleFileError,
    PayloadWriter,
    read_fields,
)

OURS = (np.arange(400).reshape(200, 2) % 7).astype(np.int64)
THEIRS = OURS + 100  # another writer's rows: what a wrong read would return


def _write(root, rows):
    with PayloadWriter(root, group="g", name="w") as w:
        return w.write({"routed_experts": rows}, pos=0)


def _outcome(segs, root) -> str:
    """``"ours"``, ``"refused"`` or what else came back."""
    try:
        got = read_fields(segs, {"routed_experts": (0, 200)}, root=root)["routed_experts"]
    except PayloadError:
        return "refused"
    rows = got.values.numpy()
    if np.array_equal(rows, OURS):
        return "ours"
    return "theirs" if np.array_equal(rows, THEIRS) else "other"


@pytest.mark.parametrize("checked", [False, True])
def test_object_replaced_after_a_refused_read_is_never_read_as_the_old_record(
    object_store, s3_url, checked
):
    import obstore

    root = PayloadRoot(s3_url, **object_store.options(verify_checksums=checked, retries=1))
    segs = _write(root, OURS)
    other = PayloadRoot(f"{s3_url}-other", **object_store.options())
    theirs = _write(other, THEIRS)
    store = root.store.client.process().store
    key = root.store.url.key(segs[0].file)
    ours = bytes(obstore.get(store, key).bytes())
    replacement = bytes(
        obstore.get(other.store.client.process().store, other.store.url.key(theirs[0].file)).bytes()
    )
    assert _outcome(segs, root) == "ours"  # header, size and ETag now cached
    obstore.put(store, key, ours[: len(ours) - 300])  # a cut copy: same header, same file id
    assert _outcome(segs, root) == "refused"
    obstore.put(store, key, replacement)  # another writer's valid object under the key
    with pytest.raises(PayloadStaleFileError):
        read_fields(segs, {"routed_experts": (0, 200)}, root=root)
    obstore.put(store, key, ours)  # restored: the record's own bytes again
    assert _outcome(segs, root) == "ours"


@pytest.mark.parametrize("reopen", [False, True])
def test_file_renamed_over_after_a_refused_read_is_never_read_as_the_old_record(tmp_path, reopen):
    root = PayloadRoot(tmp_path / "root", retries=1, backoff_s=0.001)
    segs = _write(root, OURS)
    theirs = _write(PayloadRoot(tmp_path / "other"), THEIRS)
    path = tmp_path / "root" / segs[0].file
    ours = path.read_bytes()
    replacement = (tmp_path / "other" / theirs[0].file).read_bytes()

    def rename_over(data: bytes) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        if reopen:
            root.close()  # else the reader keeps the descriptor of the file it opened

    assert _outcome(segs, root) == "ours"
    rename_over(ours[: len(ours) - 300])
    assert _outcome(segs, root) == ("refused" if reopen else "ours")
    rename_over(replacement)
    assert _outcome(segs, root) == ("refused" if reopen else "ours")
    rename_over(ours)
    assert _outcome(segs, root) == "ours"
