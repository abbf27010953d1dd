"""An object-store root (a real SeaweedFS, started once per session) reads what a local root
reads, bitwise, and fails the way the reliability contract says: typed errors naming bucket,
key, field and position; keys confined to the prefix; no credential in any text; no hang."""

import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from rollfeed.collate.cp import field_ranges, rank_ranges
from rollfeed.payload import (
    PayloadInputError,
    PayloadMissingFileError,
    PayloadPathError,
    PayloadRoot,
    PayloadStaleFileError,
    PayloadTruncatedError,
    PayloadWriter,
    read_fields,
)
from rollfeed.payload.errors import PayloadStoreAuthError, PayloadStoreTimeoutError
from rollfeed.payload.fields import PAYLOAD_FIELDS
from rollfeed.payload.stores.object_lease import merge_spans
from rollfeed.payload.stores.object_prune import incomplete_uploads
from rollfeed.payload.stores.s3 import S3Store
from tests.object_store_server import SECRET_KEY
from tests.payload.common import FIELDS, packed_micro_batch, same_read
from tests.payload.forked import run_forked

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def s3_root(server, url, **kw) -> PayloadRoot:
    root = PayloadRoot(url, **server.options(**kw))
    assert isinstance(root.store, S3Store)
    return root


def both_roots(tmp_path, server, url, seed=3, **kw):
    """The same micro batch written under a local root and under ``url``."""
    local = tmp_path / "local"
    segs_local, cu = packed_micro_batch(local, np.random.default_rng(seed), **kw)
    remote = s3_root(server, url)
    segs_s3, cu_s3 = packed_micro_batch(remote, np.random.default_rng(seed), **kw)
    assert cu == cu_s3
    return (PayloadRoot(local), segs_local), (remote, segs_s3), cu


def test_merge_spans_groups_nearby_ranges_per_object():
    span_of, f, a, b = merge_spans(
        np.array([0, 0, 0, 1]), np.array([64, 164, 9000, 64]), np.array([100, 50, 10, 10]), 4096
    )
    assert span_of.tolist() == [0, 0, 1, 2]
    assert list(zip(f.tolist(), a.tolist(), b.tolist(), strict=True)) == [
        (0, 64, 214),
        (0, 9000, 9010),
        (1, 64, 74),
    ]


@pytest.mark.parametrize("checked", [False, True])
def test_by_handle_from_the_store_equals_the_local_root_over_cp_windows(
    tmp_path, object_store, s3_url, checked
):
    (local, segs_l), (remote, segs_r), cu = both_roots(tmp_path, object_store, s3_url, unit=8)
    remote.verify_checksums = local.verify_checksums = checked
    S = cu[-1]
    for layout in ("contiguous", "zigzag"):
        for cp_size in (1, 2, 4):
            for rank in range(cp_size):
                ranges = rank_ranges(cu, rank, cp_size, layout)
                per = {f: field_ranges(ranges, PAYLOAD_FIELDS[f].window, S) for f in FIELDS}
                want = read_fields(segs_l, per, root=local)
                got = read_fields(segs_r, per, root=remote)
                assert set(got) == set(want) == set(FIELDS)
                for f in FIELDS:
                    assert same_read(got[f].values, want[f].values), (layout, cp_size, f)
                    assert torch.equal(got[f].coverage, want[f].coverage)
                    assert got[f].widest == want[f].widest


def test_each_write_is_one_object_and_prune_deletes_the_group(object_store, s3_url):
    import obstore

    root = s3_root(object_store, s3_url)
    with PayloadWriter(root, group="step_000001", name="w0") as w:
        a = w.write({"routed_experts": np.ones((5, 2), np.int64)}, pos=0)
        b = w.write({"routed_experts": np.ones((3, 2), np.int64)}, pos=5)
    assert a[0].file == "step_000001/w0-000001.rfp" and b[0].file == "step_000001/w0-000002.rfp"
    assert a[0].file_id != b[0].file_id
    with (
        pytest.raises(PayloadPathError, match="already exists"),
        PayloadWriter(root, group="step_000001", name="w0") as again,
    ):  # a second writer of the same name never overwrites a record's object
        again.write({"routed_experts": np.zeros((5, 2), np.int64)}, pos=0)
    keys = [
        m["path"]
        for batch in obstore.list(root.store.client.process().store, prefix=root.store.url.prefix)
        for m in batch
    ]
    assert sorted(keys) == [root.store.url.key(a[0].file), root.store.url.key(b[0].file)]
    root.prune("step_000001")
    with pytest.raises(PayloadMissingFileError, match="s3://rollfeed-tests/"):
        read_fields(a, {"routed_experts": (0, 5)}, root=s3_root(object_store, s3_url, retries=0))
    with pytest.raises(PayloadMissingFileError, match="nothing to prune"):
        root.prune("step_000001")


def test_keys_are_confined_to_the_prefix(object_store, s3_url):
    root = s3_root(object_store, s3_url)
    for bad in ("../other/x.rfp", "/abs.rfp", "a//b.rfp", "a/./b.rfp", "a\\b.rfp"):
        with pytest.raises(PayloadPathError):
            root.store.url.key(bad)
    with pytest.raises(PayloadPathError):
        PayloadWriter(root, group="../escape", name="w")
    with PayloadWriter(root, group="g", name="w") as w:
        segs = w.write({"routed_experts": np.ones((4, 2), np.int64)}, pos=0)
    moved = [
        s.model_copy(update={"file": "../" + s3_url.rsplit("/", 1)[1] + "/" + s.file}) for s in segs
    ]
    with pytest.raises(PayloadPathError):
        read_fields(moved, {"routed_experts": (0, 4)}, root=root)


def test_refused_credential_is_typed_and_never_shows_the_secret(object_store, s3_url):
    root = s3_root(object_store, s3_url)
    with PayloadWriter(root, group="g", name="w") as w:
        segs = w.write({"routed_experts": np.ones((4, 2), np.int64)}, pos=0)
    wrong = s3_root(object_store, s3_url, secret_access_key="not-the-secret-000")
    assert SECRET_KEY not in repr(root) and "not-the-secret" not in repr(wrong)
    with pytest.raises(PayloadStoreAuthError) as err:
        read_fields(segs, {"routed_experts": (0, 4)}, root=wrong)
    text = str(err.value)
    assert "not-the-secret" not in text and SECRET_KEY not in text
    assert "rollfeed-tests" in text and err.value.field == "routed_experts"
    assert err.value.file == segs[0].file


def test_deleted_object_and_object_shorter_than_its_records(object_store, s3_url):
    import obstore

    root = s3_root(object_store, s3_url, retries=1, backoff_s=0.01)
    with PayloadWriter(root, group="g", name="w") as w:
        segs = w.write({"routed_experts": np.arange(400).reshape(200, 2) % 7}, pos=3)
    key = root.store.url.key(segs[0].file)
    store = root.store.client.process().store
    whole = bytes(obstore.get(store, key).bytes())
    obstore.put(store, key, whole[: len(whole) - 300])  # same header and file id, cut short
    with pytest.raises(PayloadTruncatedError) as err:
        read_fields(segs, {"routed_experts": (0, 203)}, root=s3_root(object_store, s3_url))
    assert err.value.file == segs[0].file and err.value.field == "routed_experts"
    obstore.delete(store, key)
    with pytest.raises(PayloadMissingFileError, match=f"s3://rollfeed-tests/{key}"):
        read_fields(segs, {"routed_experts": (0, 203)}, root=root)


def test_object_rewritten_after_prune_is_never_read_as_the_old_record(object_store, s3_url):
    root = s3_root(object_store, s3_url)
    with PayloadWriter(root, group="g", name="w") as w:
        old = w.write({"routed_experts": np.zeros((8, 2), np.int64)}, pos=0)
    assert read_fields(old, {"routed_experts": (0, 8)}, root=root)  # cached: size, ETag, id
    root.prune("g")
    with PayloadWriter(root, group="g", name="w") as w:
        w.write({"routed_experts": np.full((8, 2), 5, np.int64)}, pos=0)  # same key, new id
    with pytest.raises(PayloadStaleFileError):
        read_fields(old, {"routed_experts": (0, 8)}, root=root)


def _read_in_child(root, segs, queue):
    try:
        got = read_fields(segs, {"routed_experts": (0, 50)}, root=root)
        with PayloadWriter(root, group="g", name="child") as w:  # a write in the worker too
            mine = w.write({"routed_experts": np.ones((3, 2), np.int64)}, pos=0)
        back = read_fields(mine, {"routed_experts": (0, 3)}, root=root)["routed_experts"].values
        queue.put((got["routed_experts"].values.numpy().tobytes(), back.sum().item()))
    except PayloadInputError as err:
        queue.put(str(err))


def _child(ctx, root, segs):
    """What a child started by ``ctx`` after the parent used the store put on its queue."""
    queue = ctx.Queue()
    child = ctx.Process(target=_read_in_child, args=(root, segs, queue))
    child.start()
    child.join(timeout=20)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive, "the worker's read hung"
    return queue.get(timeout=5)


def test_after_the_parent_used_the_store_a_fork_server_child_reads_and_a_forked_one_is_refused(
    object_store, s3_url
):
    root = s3_root(object_store, s3_url)
    with PayloadWriter(root, group="g", name="w") as w:
        segs = w.write({"routed_experts": np.arange(100).reshape(50, 2) % 9}, pos=0)
    want = read_fields(segs, {"routed_experts": (0, 50)}, root=root)["routed_experts"]
    assert _child(mp.get_context("forkserver"), root, segs) == (want.values.numpy().tobytes(), 6)
    t0 = time.monotonic()
    said = _child(mp.get_context("fork"), root, segs)  # obstore would hang there: refused
    assert "forked from one that used the object store" in said and "forkserver" in said
    assert time.monotonic() - t0 < 10
    assert (
        pickle.loads(pickle.dumps(root)).store.client._state is None
    )  # no client crosses a pickle


def test_a_child_forked_after_requests_is_refused_at_once_whatever_it_builds(object_store, s3_url):
    """obstore's runtime, started by the parent's requests, never answers in a forked child (a
    new root there gave no answer in 40 s with timeout_s=2): the parent's root, a new root, a
    writer on either and a new step directory's dataset are each refused with a typed error
    naming the ways out, well within the roots' timeouts; each child runs under a hard
    wall-clock bound."""
    from rollfeed.loaders import RolloutDataset

    bounds = {"timeout_s": 2.0, "retry_timeout_s": 4.0}
    root = s3_root(object_store, s3_url, **bounds)
    with PayloadWriter(root, group="g", name="w") as w:
        segs = w.write({"routed_experts": np.arange(12).reshape(6, 2) % 5}, pos=0)
    read_fields(segs, {"routed_experts": (0, 6)}, root=root)  # the runtime runs from here

    def fresh():
        return s3_root(object_store, s3_url, **bounds)

    def write(r):
        with PayloadWriter(r, group="child", name="w") as w:
            return w.write({"routed_experts": np.ones((3, 2), np.int64)}, pos=0)

    children = {
        "the parent's root": lambda: read_fields(segs, {"routed_experts": (0, 6)}, root=root),
        "a new root": lambda: read_fields(segs, {"routed_experts": (0, 6)}, root=fresh()),
        "a writer on the parent's root": lambda: write(root),
        "a writer on a new root": lambda: write(fresh()),
        "a new step store": lambda: RolloutDataset.from_step_dir(
            f"{s3_url}/steps", store=object_store.options(**bounds)
        ).lengths(1),
    }
    answers = {}
    for what, child in children.items():
        t0 = time.monotonic()
        kind, got = run_forked(child, 2 * bounds["retry_timeout_s"], own_group=True)
        answers[what] = (kind, time.monotonic() - t0, got)
    hung = {what: a for what, a in answers.items() if a[0] == "hang"}
    assert not hung, f"children that never answered: {hung}"
    for what, (kind, took, got) in answers.items():
        assert kind == "raised" and took < bounds["timeout_s"], (what, kind, took, got)
        module, name, message, _ = got
        assert (module, name) == ("rollfeed.payload.errors", "PayloadInputError"), (what, got)
        assert "forked from one that used the object store" in message, (what, message)
        assert "'forkserver'" in message and "before the first" in message, (what, message)


def test_store_down_then_back_retries_then_reads_and_down_for_good_is_typed(object_store, s3_url):
    root = s3_root(object_store, s3_url)
    with PayloadWriter(root, group="g", name="w") as w:
        segs = w.write({"routed_experts": np.arange(64).reshape(32, 2) % 5}, pos=0)
    want = read_fields(segs, {"routed_experts": (0, 32)}, root=root)["routed_experts"].values
    # backoff draws are random from 50 ms up (most of them short): the bound is retry_timeout_s
    patient = s3_root(object_store, s3_url, request_retries=400, retry_timeout_s=60, timeout_s=2)
    impatient = s3_root(object_store, s3_url, request_retries=2, retry_timeout_s=3, timeout_s=1)
    object_store.stop()
    try:
        t0 = time.monotonic()
        with pytest.raises(PayloadStoreTimeoutError) as err:
            read_fields(segs, {"routed_experts": (0, 32)}, root=impatient)
        assert time.monotonic() - t0 < 15 and err.value.field == "routed_experts"
        assert "rollfeed-tests" in str(err.value)
        back = threading.Timer(1.0, object_store.restart)
        back.start()
        got = read_fields(segs, {"routed_experts": (0, 32)}, root=patient)["routed_experts"]
        back.join()
    finally:
        if object_store.proc is None:
            object_store.restart()
    assert torch.equal(got.values, want)


KILLED_WRITER = """
import sys, numpy as np
from rollfeed.payload import PayloadRoot, PayloadWriter
root = PayloadRoot(sys.argv[1])
w = PayloadWriter(root, group="big", name="w")
print("writing", flush=True)
w.write({"routed_expert_weights": np.ones((8 << 20, 1), np.float32)}, pos=0)
print("written", flush=True)
"""


def test_writer_killed_mid_multipart_upload_leaves_no_object_and_prune_aborts_it(
    object_store, s3_url
):
    import obstore

    root = s3_root(object_store, s3_url)
    env = dict(os.environ, PYTHONPATH=REPO, **object_store.env())
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, s3_url], env=env, stdout=subprocess.PIPE
    )
    prefix = root.store.url.key("big") + "/"
    deadline = time.monotonic() + 60
    try:
        while not incomplete_uploads(root.store.client, prefix):  # parts are going up
            assert proc.poll() is None, "the writer finished before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        proc.kill()
        out = proc.communicate()[0]
    assert b"written" not in out
    listed = [
        m for batch in obstore.list(root.store.client.process().store, prefix=prefix) for m in batch
    ]
    assert listed == []  # nothing visible, and no record was handed out
    root.prune("big")
    assert incomplete_uploads(root.store.client, prefix) == []


def test_inspect_and_verify_over_the_store_find_a_flipped_byte(object_store, s3_url, monkeypatch):
    import obstore

    from rollfeed import cli

    root = s3_root(object_store, s3_url)
    with PayloadWriter(root, group="step_000001", name="w") as w:
        segs = w.write({"routed_experts": np.arange(600).reshape(300, 2) % 11}, pos=0)
        w.write({"routed_experts": np.ones((7, 2), np.int64)}, pos=300)
    for k, v in object_store.env().items():
        monkeypatch.setenv(k, v)
    assert cli.verify(s3_url) == 0 and cli.inspect(s3_url) == 0
    key = root.store.url.key(segs[0].file)
    store = root.store.client.process().store
    raw = bytearray(obstore.get(store, key).bytes())
    raw[segs[0].offset + 17] ^= 0x01  # one routing byte
    obstore.put(store, key, bytes(raw))
    assert cli.verify(s3_url) == 1
