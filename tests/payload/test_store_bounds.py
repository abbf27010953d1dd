"""A misbehaving store (a loopback proxy in front of the session's SeaweedFS,
:mod:`tests.payload.store_proxy`) never holds a read past its bounds, never makes it read more
than it asked for, and is named for what it does: each attempt ends by ``timeout_s`` and all of
them by ``retry_timeout_s`` however slowly the store drips; an answer claiming more bytes than
asked is refused unread; a store that ignores ``Range`` is reported as such; a paged listing of
incomplete uploads is followed to its last page. Nothing here depends on the HTTP client: the
proxy sees only requests."""

import threading
import time

import numpy as np
import pytest

from rollfeed.loaders import RolloutDataset
from rollfeed.payload import (
    PayloadError,
    PayloadIOError,
    PayloadRoot,
    PayloadStoreTimeoutError,
    PayloadWriter,
    read_fields,
)
from rollfeed.payload.stores.object_prune import incomplete_uploads
from tests.object_store_server import BUCKET
from tests.payload.store_proxy import StoreProxy, create_upload

ROWS = (np.arange(2000).reshape(1000, 2) % 9).astype(np.int64)  # 2 KB of routing


@pytest.fixture
def proxy(object_store):
    with StoreProxy(object_store.endpoint) as p:
        yield p


def written(object_store, url):
    root = PayloadRoot(url, **object_store.options())
    with PayloadWriter(root, group="g", name="w") as w:
        return w.write({"routed_experts": ROWS}, pos=0)


def through(proxy, object_store, url, **kw):
    return PayloadRoot(url, **{**object_store.options(retries=0, **kw), "endpoint": proxy.endpoint})


def bounded(fn, wait_s: float):
    """``(error raised, seconds)`` of ``fn()`` run in a thread; fails when it is still running
    after ``wait_s`` (the proxy, closed by its fixture, then lets it go)."""
    out: dict = {}

    def run():
        t0 = time.monotonic()
        try:
            fn()
        except BaseException as err:  # handed to the test
            out["err"] = err
        out["s"] = time.monotonic() - t0

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(wait_s)
    assert not th.is_alive(), f"still blocked after {wait_s} s"
    return out.get("err"), out["s"]


@pytest.mark.parametrize(
    ("mode", "timeout_s", "retries", "retry_timeout_s"),
    [("drip", 1, 2, 4), ("drip_body", 0.4, 1, 1.2)],  # headers too, or the body alone
)
def test_a_store_dripping_its_answer_is_bounded_by_the_whole_retry_sequence(
    object_store, s3_url, proxy, mode, timeout_s, retries, retry_timeout_s
):
    segs = written(object_store, s3_url)
    proxy.mode, proxy.delay_s = mode, 0.1  # a byte every 0.1 s: no receive ever times out
    bounds = dict(timeout_s=timeout_s, request_retries=retries, retry_timeout_s=retry_timeout_s)
    root = through(proxy, object_store, s3_url, **bounds)
    err, took = bounded(lambda: read_fields(segs, {"routed_experts": (0, 1000)}, root=root), 30)
    assert isinstance(err, PayloadStoreTimeoutError), err
    assert err.file == segs[0].file and f"retry_timeout_s={retry_timeout_s}" in str(err)
    assert took < retry_timeout_s + 4  # the attempts, their backoff, and a loaded machine


def test_the_step_listing_through_a_dripping_store_is_bounded(object_store, s3_url, proxy):
    proxy.mode, proxy.delay_s = "drip", 0.1
    options = {**object_store.options(), "endpoint": proxy.endpoint}
    bounds = {"timeout_s": 0.4, "request_retries": 1, "retry_timeout_s": 1.2}
    steps = RolloutDataset.from_step_dir(f"{s3_url}/steps", store={**options, **bounds})
    err, took = bounded(lambda: steps.steps_from(0), 30)
    assert isinstance(err, PayloadStoreTimeoutError) and "retry_timeout_s=1.2" in str(err), err
    assert took < 1.2 + 4


def test_an_answer_claiming_more_bytes_than_asked_is_refused_unread(object_store, s3_url, proxy):
    segs = written(object_store, s3_url)
    proxy.mode = "inflate"  # a 206 claiming 2 GiB, streaming 128 MiB of it as fast as taken
    root = through(proxy, object_store, s3_url)
    with pytest.raises(PayloadIOError, match="not the bytes asked for") as err:
        read_fields(segs, {"routed_experts": (0, 1000)}, root=root)
    assert not isinstance(err.value, PayloadStoreTimeoutError)  # named, not retried
    assert err.value.file == segs[0].file and err.value.field == "routed_experts"
    time.sleep(0.2)
    assert proxy.sent < 32 << 20  # what the sockets buffered before the client let go


def test_a_listing_claiming_gigabytes_is_refused_unread(object_store, s3_url, proxy):
    proxy.mode = "inflate"
    options = {**object_store.options(), "endpoint": proxy.endpoint}
    steps = RolloutDataset.from_step_dir(f"{s3_url}/steps", store={**options, "request_retries": 0})
    with pytest.raises(PayloadIOError, match=r"more than the \d+ an answer may take"):
        steps.steps_from(0)
    time.sleep(0.2)
    assert proxy.sent < 32 << 20


def test_a_store_that_ignores_range_is_named_as_such(object_store, s3_url, proxy):
    segs = written(object_store, s3_url)
    proxy.mode = "ignore_range"  # the store answers every ranged GET with 200, whole object
    for open_bytes in (512, 256 << 10):  # a read beyond the open's bytes; one the open covers
        root = through(proxy, object_store, s3_url, open_bytes=open_bytes)
        with pytest.raises(PayloadIOError, match="ignored Range") as err:
            read_fields(segs, {"routed_experts": (0, 1000)}, root=root)
        assert err.value.file == segs[0].file and err.value.field == "routed_experts"


def test_prune_aborts_the_uploads_of_every_page_of_the_listing(object_store, s3_url, proxy):
    root = PayloadRoot(s3_url, **object_store.options())
    prefix = root.store.url.key("big") + "/"
    made = {create_upload(object_store.endpoint, BUCKET, f"{prefix}w-{i}.rfp") for i in range(5)}
    assert {u for _, u in incomplete_uploads(root.store.client, prefix)} == made
    proxy.mode, proxy.page = "page_uploads", 2  # the store pages its listing 2 at a time
    paged = through(proxy, object_store, s3_url)
    assert {u for _, u in incomplete_uploads(paged.store.client, prefix)} == made
    paged.prune("big")
    assert incomplete_uploads(root.store.client, prefix) == []
    assert sum("uploads" in target for _, target in proxy.requests) >= 3  # three pages


def test_a_proxy_that_passes_answers_reads_exactly(object_store, s3_url, proxy):
    segs = written(object_store, s3_url)
    got = read_fields(
        segs, {"routed_experts": (0, 1000)}, root=through(proxy, object_store, s3_url)
    )
    assert np.array_equal(got["routed_experts"].values.numpy(), ROWS)
    with pytest.raises(PayloadError):  # and a store that answers garbage is typed
        proxy.mode = "garbage"
        read_fields(segs, {"routed_experts": (0, 1000)}, root=through(proxy, object_store, s3_url))
