"""Adversarial attack families on payload records, files, writers, readers and step lines.

Each family runs in its own child process under ``RLIMIT_AS`` (1 GiB) and a wall-clock bound, each
case under a per-case alarm (:mod:`tests.payload.adversary`); the families run two at a time, the
object-store ones against the session's SeaweedFS. The
writer's own arrays are the oracle: a read either raises a typed ``rollfeed`` error or returns
exactly the rows the writer was given. ``pytest -s -k adversarial`` prints the counts per family.
"""

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.payload.adversary import format_summary, run_family
from tests.payload.adversary_tally import FAILURES

FAMILIES = (
    "records",
    "bytes",
    "truncation",
    "kill",
    "races",
    "steps",
    "memory",
    "versions",
    "stores",
    "bounds",
    "fork",
    "ragged_rows",
)
STORE_FAMILIES = ("versions", "stores", "fork")  # these reach the session's S3 server
# Fewer cases than this means an attack family silently stopped attacking.
MIN_CASES = {
    "records": 2000,
    "bytes": 3000,
    "truncation": 4000,
    "kill": 40,
    "races": 500,
    "steps": 400,
    "memory": 60,
    "versions": 1000,  # the object-store sequences too: the local ones alone are fewer
    "stores": 60,
    "bounds": 450,
    "fork": 75,
    "ragged_rows": 6000,
}


@pytest.fixture(scope="module")
def summaries(tmp_path_factory, object_store):
    def one(family):
        env = object_store.env() if family in STORE_FAMILIES else None
        return run_family(family, tmp_path_factory.mktemp(f"adversary_{family}"), env=env)

    with ThreadPoolExecutor(2) as pool:
        out = dict(zip(FAMILIES, pool.map(one, FAMILIES), strict=True))
    for s in out.values():
        print(format_summary(s))
    return out


def _holds(s: dict, family: str) -> None:
    print(format_summary(s))
    failures = {k: s[k] for k in FAILURES if s[k]}
    assert not failures, format_summary(s)
    assert s["tried"] >= MIN_CASES[family], format_summary(s)
    assert s["correct"] + s["refused"] == s["tried"]


def test_mutated_records_never_read_wrong_data(summaries):
    """Every field of real records (and their JSON) at boundary values, odd types, paths out of
    the root, symlinks, a FIFO: typed refusal or the writer's exact rows, never canary bytes."""
    _holds(summaries["records"], "records")


def test_flipped_file_bytes_give_typed_errors_or_exact_data(summaries):
    """Boundary values in every header field and CSR block, random bit flips: typed errors, or
    the writer's rows (structure bytes) / the file's own new values (value bytes)."""
    _holds(summaries["bytes"], "bytes")


def test_truncation_at_every_byte_is_a_typed_error(summaries):
    """A file cut at every byte: reads are exact or typed; verify and inspect flag each cut that
    is not a region boundary, naming the file."""
    _holds(summaries["truncation"], "truncation")


def test_killed_writer_never_hands_out_an_unreadable_record(summaries):
    """A writer SIGKILLed at random points: each record it handed out reads back exactly (a typed
    error counts as wrong here); verify passes or names the incomplete file only."""
    s = summaries["kill"]
    _holds(s, "kill")
    assert s["refused"] == 0


def test_prune_and_rewrite_never_reads_old_bytes(summaries):
    """Prune and rewrite under the same writer name while a long-lived PayloadRoot reads, threads
    over a small descriptor cache, symlinks swapped in and out of the root."""
    _holds(summaries["races"], "races")


def test_crafted_step_lines_are_typed_errors(summaries):
    """Lists for objects, deep nesting, huge ints, NaN on loss tokens, crafted inline fields,
    records and step indexes: typed errors naming the line; accepted lines keep their values."""
    _holds(summaries["steps"], "steps")


def test_memory_claims_never_allocate_beyond_the_bound(summaries):
    """Records and headers claiming huge shapes, rows or values over a file of a few KiB: typed
    refusals within the allocation bound, never MemoryError."""
    _holds(summaries["memory"], "memory")


def test_replaced_objects_and_files_are_never_read_as_old_records(summaries):
    """Replace / truncate / restore sequences under old records, on an object store and a local
    root, by roots that cached earlier versions: the records' own rows or typed refusals."""
    _holds(summaries["versions"], "versions")


def test_slow_inflating_and_lying_stores_are_bounded_and_typed(summaries):
    """A proxy in front of the S3 server drips, stalls, inflates, cuts and lies to every request
    the payload and the step store make: bounded, typed, never more read than asked for."""
    _holds(summaries["stores"], "stores")


def test_outputs_past_their_bound_are_refused_before_allocation(summaries):
    """Wide rows over long windows against every output bound: refused exactly past the bound,
    exact within it, never an allocation beyond the allocation bound."""
    _holds(summaries["bounds"], "bounds")


def test_forked_children_of_object_store_users_answer_or_are_refused_never_hang(summaries):
    """Children forked after a root, a writer, a listing or a prune made requests (also with
    threads still requesting, and their own children) get a typed refusal at once, whatever they
    build; children forked before any request read and write exactly, each under a hard bound."""
    _holds(summaries["fork"], "fork")


def test_ragged_rows_misuse_is_refused_and_the_rest_is_exact(summaries):
    """Every RaggedRows entry point over dtypes, shapes, NaN / inf / negative / huge values and
    non-tensors: a RaggedRowsError, or exactly what plain Python lists say."""
    _holds(summaries["ragged_rows"], "ragged_rows")
