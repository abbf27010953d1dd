"""The stores family: slow, stalling, inflating and lying stores, a loopback proxy
(:mod:`tests.payload.store_proxy`) in front of the session's S3 server, attacked through every
request the payload makes of a store.

Each case sets one misbehaviour (for every request, or for every request after the first) and
runs one operation through the proxy under small bounds (each attempt ``TIMEOUT_S``, all of
them ``RETRY_TIMEOUT_S``): the first read of an object (its open), a later read of an object
already open (a ranged GET with ``If-Match``), a step store's listing, a step index fetched
whole, a writer's PUT, the listing of incomplete uploads. A case is correct when the operation
gives what the store holds (a read the writer's rows, a write records that read back exactly),
refused when it raises a typed error, and a hang past the per-case bound, an untyped error or
an allocation beyond the bound (an answer claiming 2 GiB, streamed as fast as it is taken,
under the family's 1 GiB address space) is a failure: no store makes the client wait past its
bounds or read more than it asked for.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from tests.payload.adversary_corpus import request_arrays
from tests.payload.adversary_oracle import FIELDS, check_read, write_request
from tests.payload.adversary_tally import Tally, Wrong

TIMEOUT_S, RETRIES, RETRY_TIMEOUT_S = 0.15, 1, 0.35
MODES = (
    "pass",
    "drip",
    "drip_body",
    "stall_body",
    "inflate",
    "lie_length",
    "lie_range",
    "short",
    "ignore_range",
    "garbage",
)
SLOW = {"drip", "drip_body", "stall_body"}  # each case waits out its bounds: fewer operations
SLOW_OPS = ("first read", "later read", "step listing", "write")
SEVERAL = ("step index", "write")  # operations of several requests: the first may pass


def family_stores(tally: Tally, workdir: Path, rng: np.random.Generator) -> None:
    """Every misbehaviour against every operation (see the module doc)."""
    from rollfeed.loaders import RolloutDataset, write_step_file
    from rollfeed.payload import PayloadRoot, PayloadWriter
    from tests.object_store_server import BUCKET
    from tests.payload.store_proxy import StoreProxy

    endpoint = os.environ["AWS_ENDPOINT_URL"]  # the session's S3 server, passed on by the test
    base = f"s3://{BUCKET}/adversary-stores-{os.getpid()}-{int(rng.integers(1 << 30))}"
    regions: dict = {}
    direct = PayloadRoot(base, retries=0)
    with PayloadWriter(direct, group="g", name="w") as w:
        segs = write_request(w, request_arrays(rng, 150), regions)
    steps_url = f"{base}/steps"
    write_step_file(steps_url, 1, _samples())
    bounds = dict(timeout_s=TIMEOUT_S, request_retries=RETRIES, retry_timeout_s=RETRY_TIMEOUT_S)
    total = segs[0].rows
    with StoreProxy(endpoint) as proxy:
        proxy.delay_s, proxy.claim, proxy.stream = 0.05, 2 << 30, 2 << 30

        def root(**kw):
            return PayloadRoot(base, endpoint=proxy.endpoint, retries=0, **bounds, **kw)

        def read(r, name):
            w = [(0, total + 1)]
            check_read(_read(segs, name, w, r), segs, name, w, regions)

        def first_read(name):
            read(root(), name)

        def later_read(name):  # the open's bytes do not cover the body: a second, ranged GET
            r = root(open_bytes=512)
            with proxy.passing():
                read(r, "routed_experts")
            read(r, name)

        def steps():
            store = {"endpoint": proxy.endpoint, **bounds}
            return RolloutDataset.from_step_dir(steps_url, store=store)

        def listing(_):
            got = steps().steps_from(0)
            if got != [1]:
                raise Wrong(f"the step prefix listed {got}, the store holds [1]")

        def index(_):
            got = steps().lengths(1)
            if got.tolist() != [3, 4]:
                raise Wrong(f"the step file's index read back as {got}")

        def write(name):
            r = root()
            group = f"w{int(rng.integers(1 << 30))}"
            mine: dict = {}
            with PayloadWriter(r, group=group, name="w") as w:
                got = write_request(w, request_arrays(rng, 20), mine)
            back = PayloadRoot(base, retries=0)  # the records handed out read back exactly
            for f in FIELDS:
                check_read(_read(got, f, [(0, 20)], back), got, f, [(0, 20)], mine)

        def uploads(_):
            from rollfeed.payload.stores.object_prune import incomplete_uploads

            got = incomplete_uploads(root().store.client, direct.store.url.key("none") + "/")
            if got:
                raise Wrong(f"listed uploads {got} under a prefix that has none")

        operations = {
            "first read": first_read,
            "later read": later_read,
            "step listing": listing,
            "step index": index,
            "write": write,
            "upload listing": uploads,
        }
        for mode in MODES:
            for after_first in (False, True):
                for what, op in operations.items():
                    if (mode in SLOW and (after_first or what not in SLOW_OPS)) or (
                        after_first and what not in SEVERAL
                    ):
                        continue
                    name = FIELDS[int(rng.integers(len(FIELDS)))]

                    def attack(op=op, name=name, mode=mode, after_first=after_first):
                        proxy.misbehave(mode, after_first=after_first)
                        try:
                            op(name)
                        finally:
                            proxy.misbehave("pass")

                    when = "after the first request" if after_first else "from the first request"
                    # a store that behaves gives what it holds: a refusal then is wrong
                    ok = mode != "pass"
                    tally.case(f"stores: {mode} {when}: {what} ({name})", attack, refusal_ok=ok)


def _read(segs, name, w, root):
    from rollfeed.payload import read_field

    return read_field(segs, name, w, root=root)


def _samples():
    """Two samples of 3 and 4 tokens."""
    from rollfeed.collate import Sample

    def sample(n: int) -> Sample:
        mask = np.ones(n, np.int64)
        mask[0] = 0
        return Sample(
            np.arange(1, n + 1),
            loss_mask=mask,
            advantages=np.full(n, 0.5),
            inference_logprobs=np.full(n, -0.5),
        )

    return [sample(3), sample(4)]
