"""The capture server at its edges: names and integers it refuses, a group pruned under it, a
client that goes away, and the server itself killed mid-request (the session's one engine)."""

from __future__ import annotations

import json
import socket
import threading
from urllib.parse import urlsplit

import pytest

from rollfeed.capture.errors import CaptureServerError
from rollfeed.capture.protocol import ROUTE
from rollfeed.cli import main as cli
from rollfeed.orchestrator.client import CaptureClient
from rollfeed.payload import PayloadRoot
from tests.capture.engine_metrics import engine_counts, wait_for
from tests.capture.kept import read_kept
from tests.capture.slowed_engine import slowed

pytestmark = pytest.mark.vllm

SAMPLING = {"top_k": 5, "top_p": 0.9, "temperature": 0.8, "ignore_eos": True}
# 16 completions of up to 480 tokens, one at a time (the session's server runs one sequence at
# a time), ~20 s at full speed: the engine, slowed (tests/capture/slowed_engine.py) from before
# the request, is far from its end when the client goes or the server is killed.
N = 16
LONG = dict(SAMPLING, max_tokens=480, n=N, seed=1)


@pytest.fixture(scope="module")
def client(capture_server):
    return CaptureClient(capture_server.url, timeout_s=300)


def started(url: str, before: dict[str, float], seen: dict[str, float]) -> bool:
    """The engine is on a new request: it runs one, or has generated tokens since ``before``
    (a poll can fall between two of its steps); ``seen`` keeps the last counts for the message."""
    seen.update(engine_counts(url))
    return seen["running"] >= 1 or seen["tokens"] > before["tokens"]


def post(client: CaptureClient, body: dict) -> None:
    client._call(ROUTE, json.dumps(body).encode())


@pytest.mark.parametrize(
    ("group", "reason"),
    [
        ("g" * 256, "is 256 bytes"),
        ("step 42", "' ' at position 4"),
        ("step\n42", "'\\n' at position 4"),
        ("step%2F42", "'%' at position 4"),
        (".step_42", "a component that is empty or starts with"),
    ],
)
def test_group_names_outside_the_rule_are_refused_with_http_400_naming_it(client, group, reason):
    body = {"token_ids": [1, 2, 3], "group": group, "sampling": dict(SAMPLING, max_tokens=2)}
    with pytest.raises(CaptureServerError, match="HTTP 400") as err:
        post(client, body)
    assert reason in str(err.value) and "a group is 1 to 255 bytes" in str(err.value)


@pytest.mark.parametrize("key", ["max_tokens", "seed"])
def test_an_integer_beyond_64_bits_is_refused_with_http_400_naming_it(client, key):
    sampling = dict(SAMPLING, max_tokens=2) | {key: 2**64}
    with pytest.raises(CaptureServerError, match="HTTP 400") as err:
        client.generate([1, 2, 3], group="t-refused", sampling=sampling)
    assert f"{key}={2**64} lies outside the signed 64-bit integers" in str(err.value)


def test_a_group_pruned_between_requests_answers_records_a_reader_reaches(client, capture_server):
    root, sampling = capture_server.root, dict(SAMPLING, max_tokens=4, seed=5)
    (first,) = client.generate([1, 2, 3], group="t-pruned", sampling=sampling).completions
    PayloadRoot(root).prune("t-pruned")  # the trainer is done with the group; the server is not
    (again,) = client.generate([1, 2, 3], group="t-pruned", sampling=sampling).completions
    kept = read_kept(again.segments, root, 3, 7, again.token_ids)
    assert [row[y] for row, y in zip(kept, again.token_ids, strict=True)] == [
        pytest.approx(lp, abs=0) for lp in again.logprobs
    ]
    assert {s.file for s in again.segments} != {s.file for s in first.segments}


def test_a_client_that_disconnects_cancels_its_generation(client, capture_server):
    url = capture_server.url
    before = engine_counts(url)
    body = json.dumps({"token_ids": [1, 2, 3], "group": "t-gone", "sampling": LONG}).encode()
    where = urlsplit(url)
    head = f"POST {ROUTE} HTTP/1.1\r\nHost: {where.netloc}\r\nContent-Type: application/json"
    request = f"{head}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
    with (
        socket.create_connection((where.hostname, where.port)) as sock,
        slowed(capture_server.process),
    ):
        sock.sendall(request)
        seen: dict[str, float] = {}
        assert wait_for(lambda: started(url, before, seen), timeout_s=120), (before, seen)
        sock.close()  # a few tokens in: the server drops the request, the engine slowed
        assert wait_for(lambda: client.info().requests_running == 0, timeout_s=30)
    now = {}

    def cancelled() -> bool:
        now.update(engine_counts(url))
        return now["running"] == now["waiting"] == 0

    assert wait_for(cancelled, timeout_s=10), now  # the engine, going on, aborts the request
    assert now["tokens"] - before["tokens"] < N * 480  # cut short: N x 480 is the whole request


@pytest.mark.kills_capture_server
def test_server_killed_mid_request(client, capture_server, capsys):
    root, errors = capture_server.root, []
    short = dict(SAMPLING, max_tokens=3, seed=0)
    client.generate([1, 2, 3], group="t-killed", sampling=short)  # the kill leaves a file here
    client.generate([1, 2, 3], group="t-kept", sampling=short)  # a sound group that stays

    def long_request():
        try:
            client.generate([1, 2, 3], group="t-killed", sampling=LONG)
        except CaptureServerError as err:
            errors.append(err)

    before, seen = engine_counts(capture_server.url), {}
    thread = threading.Thread(target=long_request)
    with slowed(capture_server.process):  # the kill comes a few tokens in
        thread.start()
        assert wait_for(lambda: started(capture_server.url, before, seen), timeout_s=120), (
            before,
            seen,
            errors,
        )
        capture_server.kill()
    thread.join(timeout=60)
    assert not thread.is_alive()
    (err,) = errors
    assert err.status is None and "no record came back" in str(err)
    capsys.readouterr()
    code = cli(["verify", str(root)])  # sound, or naming the file the kill cut short
    assert code == 0 or "BAD t-killed/" in capsys.readouterr().out
    PayloadRoot(root).prune("t-killed")
    assert not (root / "t-killed").exists()
    assert cli(["verify", str(root)]) == 0  # what is left (t-kept at least) is sound
