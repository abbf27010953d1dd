"""Attack family ``cursor`` of the adversary harness (:mod:`tests.payload.adversary`): a producer's
cursor log cut, flipped, padded, spliced and forged, then opened by a producer's cursor.

The corpus is the log of a real (stand-in client) producer run of 3 steps. Each case writes a
changed log and opens it with :class:`~rollfeed.orchestrator.cursor.RolloutCursor`. The oracle:

- the log cut at any byte, or with garbage or zeros after its end, or with a bit flipped inside its
  last record, reads back as the records that lie whole before the damage (the torn tail of an
  interrupted append; a cursor that returns anything else is ``wrong``);
- a bit flipped, bytes inserted or a record removed before the last record, or a whole record of
  another number at the end, must be refused (a typed error): an interrupted append never leaves
  a whole record, and reading on would hand out records after a damaged one;
- forged records (valid frames whose events contradict the ones before: a step begun twice, an
  answer to a turn never sent, a rollout finished twice, a step written before its rollouts
  finished, an event of another version, a frame claiming 4 GiB) must be refused or, for the
  size claim, be a torn tail; a cursor that opens with them is ``wrong``.
"""

from __future__ import annotations

import json
from pathlib import Path

import crc32c
import numpy as np

from rollfeed.orchestrator import Producer, ProducerConfig
from rollfeed.orchestrator.cursor import RolloutCursor
from rollfeed.orchestrator.cursor_frames import HEADER, frame, scan
from rollfeed.orchestrator.cursor_log import FOLDER, LOG_NAME
from rollfeed.orchestrator.groups import Prompt
from tests.orchestrator.fake_client import FakeClient
from tests.payload.adversary_tally import Tally, Wrong


def _corpus(workdir: Path) -> bytes:
    prompts = [Prompt(id=f"p{i}", token_ids=(1, 2, 3 + i)) for i in range(6)]
    config = ProducerConfig(group_size=2, prompts_per_step=2, sampling={"seed": 1}, max_ahead=9)
    Producer(
        FakeClient(), workdir / "corpus", prompts, reward=lambda p, r: 1.0, config=config
    ).run()
    return (workdir / "corpus" / FOLDER / LOG_NAME).read_bytes()


def _ends(data: bytes) -> list[int]:
    """The offset where each whole record ends."""
    ends, at = [], 0
    while at < len(data):
        size = HEADER.unpack_from(data, at)[1]
        at += HEADER.size + size
        ends.append(at)
    return ends


class _Case:
    def __init__(self, workdir: Path) -> None:
        self.workdir, self.n = workdir, 0

    def open(self, data: bytes) -> list[bytes]:
        self.n += 1
        where = self.workdir / f"case{self.n}"
        (where / FOLDER).mkdir(parents=True)
        (where / FOLDER / LOG_NAME).write_bytes(data)
        with RolloutCursor(where, fsync=False) as cursor:
            return list(cursor.log.records)


def family_cursor(tally: Tally, workdir: Path, rng: np.random.Generator) -> None:
    log = _corpus(workdir)
    records = scan(log).payloads
    ends = _ends(log)
    last_start = ends[-2]
    case = _Case(workdir)

    def expect_prefix(data: bytes, keep: int):
        def attack():
            got = case.open(data)
            if got != records[:keep]:
                raise Wrong(f"read {len(got)} records, the first {keep} were whole")

        return attack

    def expect_refusal(data: bytes):
        def attack():
            got = case.open(data)
            raise Wrong(f"opened a damaged log and read {len(got)} records")

        return attack

    cuts = sorted(set(rng.integers(1, len(log), 60).tolist()) | {1, len(log) - 1, last_start + 1})
    for cut in cuts:
        keep = sum(1 for e in ends if e <= cut)
        tally.case(f"cut at byte {cut} of {len(log)}", expect_prefix(log[:cut], keep))
    for tail in (bytes(64), rng.bytes(40), b"RFC1" + bytes(30), frame(len(records), b"{}")[:30]):
        tally.case(f"{len(tail)} bytes after the end", expect_prefix(log + tail, len(records)))
    for number in (len(records) + 1, len(records) - 1, 0):
        whole = frame(number, records[-1])
        tally.case(f"a whole record numbered {number} at the end", expect_refusal(log + whole))
    for at in rng.integers(last_start, len(log), 10).tolist():
        flipped = bytearray(log)
        flipped[at] ^= 1 << int(rng.integers(8))
        tally.case(
            f"bit flipped in the last record at {at}",
            expect_prefix(bytes(flipped), len(records) - 1),
        )
    for at in rng.integers(0, last_start, 40).tolist():
        flipped = bytearray(log)
        flipped[at] ^= 1 << int(rng.integers(8))
        tally.case(f"bit flipped at {at} before the last record", expect_refusal(bytes(flipped)))
    for at in rng.choice(ends[:-1], 8).tolist():
        junk = rng.bytes(int(rng.integers(1, 50)))
        tally.case(
            f"{len(junk)} bytes inserted at {at}", expect_refusal(log[:at] + junk + log[at:])
        )
    for i in rng.choice(len(records) - 1, 6, replace=False).tolist():
        start = 0 if i == 0 else ends[i - 1]
        tally.case(f"record {i} removed", expect_refusal(log[:start] + log[ends[i] :]))

    events = [json.loads(r)["event"] for r in records]
    begun = next(e for e in events if e["kind"] == "begun")
    done = next(e for e in events if e["kind"] == "done")
    finished = next(e for e in events if e["kind"] == "finished")
    forged = {
        "a step begun twice": begun,
        "a rollout finished twice": finished,
        "an answer for a rollout its step does not hold": done | {"prompt": "p1", "step": 2},
        "an answer to a finished rollout": done,
        "an event of a step never begun": finished | {"step": 40},
        "a step written before its rollouts": {"kind": "written", "step": 40, "samples": 1},
        "an event of another version": {"kind": "merged", "step": 0},
        "a record that is not JSON": None,
    }
    for name, event in forged.items():
        payload = b"\xff{" if event is None else json.dumps({"event": event}).encode()
        data = log + frame(len(records), payload)
        tally.case(f"forged: {name}", expect_refusal(data))
    big = bytearray(frame(len(records), b"{}"))
    big[4:8] = (0xFFFFFFFF).to_bytes(4, "little")  # a size claim of 4 GiB, header checksum redone
    big[20:24] = crc32c.crc32c(bytes(big[:20])).to_bytes(4, "little")
    tally.case("a header claiming 4 GiB", expect_prefix(log + bytes(big), len(records)))
