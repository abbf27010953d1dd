"""The step family: crafted sample lines (an orchestrator's JSON records, and JSON-lines step files
as ``steps convert`` reads them) and crafted step record files (every field of a record's header,
of its column, text and segment descriptors, of an index row and of the footer, set to values no
writer makes, the checksums made to match so that only the structure is checked); typed errors
naming the line or the file and sample, and what is accepted keeps its values and goes through
the collate pipeline with typed errors only."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from pathlib import Path

import crc32c
import numpy as np

from tests.payload.adversary_corpus import build_corpus
from tests.payload.adversary_tally import Tally, Wrong

GOOD = {
    "token_ids": [1, 2, 3],
    "loss_mask": [0, 1, 1],
    "advantages": [0.0, 0.5, 0.5],
    "inference_logprobs": [0.0, -0.7, -0.1],
}


def crafted_lines() -> list[tuple[str, bytes]]:
    """``(description, line)``: step-file lines an orchestrator bug or an attacker could write."""

    def rec(**kw):
        return json.dumps({**GOOD, **kw}).encode()

    deep = 100_000
    lines = [
        ("list instead of object", b"[1, 2, 3]"),
        ("string", b'"sample"'),
        ("number", b"7"),
        ("null", b"null"),
        ("empty object", b"{}"),
        ("deep list nesting", b"[" * deep + b"]" * deep),
        ("deep object nesting", b'{"a":' * deep + b"1" + b"}" * deep),
        ("deep nesting in token_ids", rec()[:-1] + b', "uid": ' + b"[" * deep + b"]" * deep + b"}"),
        ("not JSON", b"token_ids=1,2,3"),
        ("invalid UTF-8", b'{"token_ids": [1], "\xff\xfe": 1}'),
        ("NUL bytes", b'{"token_ids\x00": [1]}'),
        ("truncated", rec()[:-7]),
        ("fields as a list", rec(fields=[1, 2])),
        ("fields entry as a list", rec(fields={"sampling_mask": [[0, 1, 1], [5, 6]]})),
        ("fields entry as a string", rec(fields={"sampling_mask": "x"})),
        ("payload as a string", rec(payload="abc")),
        ("payload as an object", rec(payload={"field": "x"})),
        ("payload entry as a list", rec(payload=[[1, 2]])),
        ("uid as a list", rec(uid=[1])),
        ("duplicate keys", b'{"token_ids": [1], "token_ids": [1, 2, 3], ' + rec()[1:]),
    ]
    for key in ("token_ids", "loss_mask", "advantages", "inference_logprobs", "temperatures"):
        for what, value in [
            ("2**63", [1, 2**63, 3]),
            ("2**64", [1, 2**64, 3]),
            ("10**400", [1, 10**400, 3]),
            ("-2**63-1", [1, -(2**63) - 1, 3]),
            ("1e400", [1, 1e400, 3]),
            ("string", "abc"),
            ("object", {"a": 1}),
            ("nested lists", [[1, 2], [3]]),
            ("bools", [True, False, True]),
            ("nulls", [None, None, None]),
            ("too short", [1]),
            ("empty", []),
            ("mixed", [1, "a", 2.5]),
            ("float 1.5", [1, 1.5, 2]),
        ]:
            lines.append((f"{key} {what}", rec(**{key: value})))
    for key in ("advantages", "inference_logprobs", "temperatures"):
        for bad in ("NaN", "Infinity", "-Infinity"):
            line = json.dumps({**GOOD, key: [0.0, 0.0, 0.0]}).encode()
            lines.append(
                (f"{key} {bad} on a loss token", line.replace(b"0.0]", bad.encode() + b"]"))
            )
    fixed = {"dtype": "uint8", "shape": [3, 2], "data": [1, 2, 3, 4, 5, 6]}
    for what, edit in [
        ("huge shape", {"shape": [3, 2**40]}),
        ("negative shape", {"shape": [-1, 2]}),
        ("shape string", {"shape": "x"}),
        ("dtype object", {"dtype": "object"}),
        ("dtype V8", {"dtype": "V8"}),
        ("dtype U3", {"dtype": "U3"}),
        ("dtype 5", {"dtype": 5}),
        ("dtype M8", {"dtype": "datetime64[s]"}),
        ("data nested", {"data": [[[1]] * 6]}),
        ("data strings", {"data": ["a"] * 6}),
        ("data 2**70", {"data": [2**70] * 6}),
        ("no data", {"data": None}),
        ("shape of 40 dims", {"shape": [1] * 40, "data": [1]}),
        ("wide shape", {"shape": [3, 2**20], "data": [1, 2, 3, 4, 5, 6]}),
    ]:
        lines.append(
            (f"inline routed_experts {what}", rec(fields={"routed_experts": {**fixed, **edit}}))
        )
    ragged = {"counts": [0, 1, 1], "values": [5, 6]}
    for what, edit in [
        ("counts 2**40", {"counts": [0, 2**40, 1]}),
        ("counts 2**63", {"counts": [0, 2**63, 1]}),
        ("negative counts", {"counts": [0, -1, 1]}),
        ("counts floats", {"counts": [0, 1.5, 1]}),
        ("values 2**40", {"values": [5, 2**40]}),
        ("values strings", {"values": ["a", "b"]}),
        ("values nested", {"values": [[5], [6]]}),
        ("no values", {"values": None}),
        ("counts object", {"counts": {"a": 1}}),
    ]:
        lines.append(
            (f"inline sampling_mask {what}", rec(fields={"sampling_mask": {**ragged, **edit}}))
        )
    seg = {
        "field": "routed_experts",
        "file": "g/a.rfp",
        "offset": 70,
        "pos": 0,
        "rows": 0,
        "dtype": "float64",
        "shape": [2**24 - 1],
    }
    for what, edit in [
        ("zero rows, huge row shape", {}),
        ("rows 2**62", {"rows": 2**62, "shape": [2, 3]}),
        ("first 2**62-1", {"rows": 3, "first": 2**62 - 1, "dtype": "uint8", "shape": [2, 3]}),
        ("shape [2**31, 2**31]", {"shape": [2**31, 2**31]}),
        ("offset true", {"offset": True}),
        ("file ../x", {"file": "../outside/g/a.rfp", "rows": 3, "dtype": "uint8", "shape": [2, 3]}),
    ]:
        lines.append((f"payload segment {what}", rec(payload=[{**seg, **edit}])))
    return lines


def _loss_bearing_nonfinite(data) -> bool:
    if not isinstance(data, dict):
        return False
    mask = data.get("loss_mask")
    for key in ("advantages", "inference_logprobs"):
        vals = data.get(key)
        if isinstance(vals, list) and isinstance(mask, list) and len(vals) == len(mask):
            for t in range(1, len(vals)):
                if mask[t] == 1 and isinstance(vals[t], float) and not math.isfinite(vals[t]):
                    return True
    return False


def family_steps(tally: Tally, workdir: Path, rng: np.random.Generator) -> None:
    """Crafted lines: ``Sample.from_json`` and the conversion of a JSON-lines step file raise
    typed errors (the conversion's naming line 3); an accepted line holds exactly its JSON values,
    and goes through ``prepare_batch`` and ``to_tensor_micro_batch`` with typed errors only
    (non-finite advantages or logprobs on loss-bearing tokens must be refused on the way). Then
    crafted step record files (:func:`_binary`)."""
    from rollfeed.cli.step_convert import LineError, convert_step
    from rollfeed.collate import Sample
    from rollfeed.loaders import read_step_file

    corpus = build_corpus(workdir, rng)
    good = json.dumps(GOOD).encode()
    for j, (what, line) in enumerate(crafted_lines()):
        try:
            data = json.loads(line)
        except (ValueError, RecursionError):
            data = None
        through = _through(corpus.root, data)
        if data is not None:
            tally.case(
                f"steps: Sample.from_json {what}",
                lambda line=line, f=through: f(Sample.from_json(line)),
            )
        directory = workdir / f"s{j}"
        directory.mkdir()
        (directory / "step_000001.jsonl").write_bytes(b"\n".join([good, good, line, good]) + b"\n")

        def converted(directory=directory, what=what, f=through):
            try:
                convert_step(str(directory), 1, "step_000001.jsonl")
            except LineError as err:
                if err.line != 3:
                    raise Wrong(f"the error names line {err.line}, the crafted line is 3") from None
                raise
            samples = read_step_file(directory / "step_000001.rfs")
            if len(samples) != 4:
                raise Wrong(f"{len(samples)} samples from a file of 4 lines ({what})")
            f(samples[2])

        tally.case(f"steps: steps convert with {what} at line 3", converted)
    _binary(tally, workdir, corpus)


def _through(root, data) -> Callable:
    """The oracle of an accepted sample (``data``: its JSON record, when known)."""
    from rollfeed.collate import PlanConfig, prepare_batch, to_tensor_micro_batch

    def through(sample) -> None:
        ids = data.get("token_ids") if isinstance(data, dict) else None
        if isinstance(ids, list) and sample.token_ids.tolist() != ids:
            raise Wrong(f"token_ids {ids} became {sample.token_ids.tolist()}")
        plan = prepare_batch([sample], PlanConfig(seq_len=64), dp_size=1)
        for mb in plan[0]:
            to_tensor_micro_batch(mb, cp_rank=0, root=root)
        if _loss_bearing_nonfinite(data if data is not None else json.loads(sample.to_json())):
            raise Wrong("a non-finite advantage or logprob on a loss-bearing token passed")

    return through


def _base_samples(corpus) -> list:
    """Three samples: inline fields fixed and ragged, temperatures, a uid, segment records."""
    from rollfeed.collate import Sample

    segs = [s for s in corpus.requests[0] if s.field == "routed_experts"]
    out = []
    for k, T in enumerate((9, 3, 12)):
        ids = np.arange(10, 10 + T) * (k + 1)
        out.append(
            Sample(
                ids,
                loss_mask=np.arange(T) > 1,
                advantages=np.full(T, 0.5, np.float32) if k != 2 else np.linspace(0, 1, T),
                inference_logprobs=-np.linspace(0.1, 1, T).astype(np.float32),
                temperatures=np.ones(T, np.float32) if k == 0 else None,
                fields={"sampling_mask": (np.ones(T, np.int64), ids)} if k != 1 else None,
                payload=segs if k == 2 else None,
                uid=f"u{k}",
            )
        )
    return out


def _binary(tally: Tally, workdir: Path, corpus) -> None:
    """Every field of step record file ``step_000000.rfs`` set to values no writer makes, the
    checksums made to match (:func:`_resealed`): ``read_step_file`` raises a typed error naming the
    file, or gives samples that go through the collate pipeline with typed errors only."""
    from rollfeed.loaders import read_step_file, write_step_file
    from rollfeed.payload.format import step_record_codec as codec
    from rollfeed.payload.format.step_layout import FOOTER, INDEX_ROW

    base = workdir / "binary"
    path = Path(write_step_file(base, 0, _base_samples(corpus)))
    good = path.read_bytes()
    index_at, _, n, *_ = FOOTER.unpack(good[-FOOTER.size :])
    rows = np.frombuffer(good, INDEX_ROW, n, index_at)
    through = _through(corpus.root, None)
    for case, (place, at, fmt, value) in enumerate(_fields(good, rows, codec)):
        if struct.unpack_from(fmt, good, at)[0] == value:
            continue  # the field holds that value already: no attack
        data = bytearray(good)
        struct.pack_into(fmt, data, at, value)
        target = workdir / "b" / f"c{case}" / "step_000000.rfs"
        target.parent.mkdir(parents=True)
        target.write_bytes(_resealed(bytes(data), records=at < index_at, index=at < len(good) - 48))

        def attack(target=target) -> None:
            from rollfeed.loaders import StepFileError

            try:
                samples = read_step_file(target)
            except StepFileError as err:
                if err.file != str(target):
                    raise Wrong(f"the error names {err.file}, not {target}") from None
                raise
            for sample in samples:
                through(sample)

        tally.case(f"steps: step record file {place} = {value}", attack)


def _fields(good: bytes, rows: np.ndarray, codec) -> list[tuple[str, int, str, int]]:
    """``(place, byte offset, struct format, value)`` of every crafted field."""
    from rollfeed.payload.format.step_layout import INDEX_ROW

    out = []
    for i, row in enumerate(rows):
        at = int(row["offset"])
        _, id_code, _, C, X, K, S, T, R, N = codec.RECORD_HEADER.unpack_from(good, at)
        head = [
            ("id dtype", 4, "<B", (4, 255)),
            ("columns", 6, "<H", (0, C + 1, 0xFFFF)),
            ("texts", 8, "<H", (X + 1, 0xFFFF)),
            ("marked spans", 10, "<H", (K + 1, 0xFFFF)),
            ("segments", 12, "<I", (S + 1, 2**32 - 1)),
            ("tokens", 16, "<Q", (0, T - 1, T + 1, 2**63, 2**64 - 1)),
            ("runs", 24, "<I", (R + 1, 2**32 - 1)),
            ("strings", 28, "<I", (0, N + 1, 2**32 - 1)),
            ("magic", 0, "<I", (0,)),
        ]
        out += [(f"record {i} {k}", at + o, f, v) for k, o, f, vs in head for v in vs]
        isz = (1, 2, 4, 8)[id_code]
        cols_at = at + 32 + -(-T * isz // 8) * 8 + 8 * R + 8 * K
        col = codec.COLUMN.fields
        for c in range(C if i == 0 else 1):
            d = cols_at + c * codec.COLUMN.itemsize
            edits = [
                ("name_off", "<I", (2**32 - 1,)),
                ("name_len", "<H", (0, 0xFFFF)),
                ("encoding", "<B", (0, 1, 2, 3, 255)),
                ("dtype", "<B", (0, 8, 10, 12, 255)),
                ("stored", "<B", (0, 7, 9, 12, 255)),
                ("ndim", "<B", (1, 4, 5, 255)),
                ("rows", "<Q", (0, T - 1, T + 1, 2**40, 2**64 - 1)),
                ("data", "<Q", (0, 8, 2**63)),
                ("dims", "<I", (0, 2**31)),
            ]
            out += [
                (f"record {i} column {c} {k}", d + col[k][1], f, v)
                for k, f, vs in edits
                for v in vs
            ]
        texts_at = cols_at + C * codec.COLUMN.itemsize
        for x in range(min(X, 1)):
            d = texts_at + x * codec.TEXT.itemsize
            out += [
                (f"record {i} text {k}", d + codec.TEXT.fields[k][1], "<I", v)
                for k in ("name_off", "name_len", "off", "len")
                for v in (N + 1, 2**32 - 1)
            ]
        segs_at = texts_at + X * codec.TEXT.itemsize
        for g in range(min(S, 1)):
            d = segs_at + g * codec.SEGMENT.itemsize
            seg = codec.SEGMENT.fields
            edits = [
                ("field_len", "<H", (0, 0xFFFF)),
                ("ndim", "<B", (0, 5, 255)),
                ("flags", "<B", (0, 1, 3, 255)),
                ("offset", "<q", (-1, 2**62)),
                ("pos", "<q", (-1, 2**62)),
                ("rows", "<q", (-1, 2**62)),
                ("first", "<q", (2**62,)),
                ("r_values", "<q", (-1,)),
                ("shape", "<q", (0, 2**40)),
            ]
            out += [
                (f"record {i} segment {g} {k}", d + seg[k][1], f, v)
                for k, f, vs in edits
                for v in vs
            ]
    index_at = struct.unpack_from("<Q", good, len(good) - 48)[0]
    fields = INDEX_ROW.fields
    last = len(rows) - 1
    for k, f, vs in [
        ("offset", "<Q", (0, 8)),
        ("size", "<Q", (0, 8, 2**63)),
        ("tokens", "<Q", (0, 2**62)),
        ("runs", "<I", (0, 2)),
        ("spans", "<I", (1, 2**32 - 1)),
        ("reserved", "<I", (1,)),
        ("policy_version", "<q", (-2, 2**62)),
        ("group", "<Q", (0, 1)),
        ("shared", "<Q", (1, 2**40)),
    ]:
        out += [
            (f"index row {last} {k}", index_at + last * INDEX_ROW.itemsize + fields[k][1], f, v)
            for v in vs
        ]
    foot = len(good) - 48
    for k, o, vs in [
        ("index offset", 0, (0, index_at - 8, index_at + 8)),
        ("index bytes", 8, (0, 2**40)),
        ("records", 16, (0, len(rows) + 1, 2**62)),
        ("file id", 24, (0, 1)),
    ]:
        out += [(f"footer {k}", foot + o, "<Q", v) for v in vs]
    return out


def _resealed(data: bytes, *, records: bool, index: bool) -> bytes:
    """``data`` with its checksums made to match: each record's in the index (``records``: a
    record changed), the index's in the footer (``index``: a record or the index changed) and the
    footer's own; a footer that no longer places its index is left as it is."""
    from rollfeed.payload.format.step_layout import INDEX_ROW

    data = bytearray(data)
    offset, size, n = struct.unpack_from("<QQQ", data, len(data) - 48)
    fits = offset + size == len(data) - 48 and n * INDEX_ROW.itemsize <= size
    if fits and index:
        if records:
            rows = np.frombuffer(data, INDEX_ROW, n, offset).copy()
            rows["crc32c"] = [
                crc32c.crc32c(bytes(data[r["offset"] : r["offset"] + r["size"]])) for r in rows
            ]
            data[offset : offset + rows.nbytes] = rows.tobytes()
        struct.pack_into(
            "<I", data, len(data) - 16, crc32c.crc32c(bytes(data[offset : offset + size]))
        )
    struct.pack_into(
        "<I", data, len(data) - 12, crc32c.crc32c(bytes(data[len(data) - 48 : len(data) - 12]))
    )
    return bytes(data)
