"""The step-line family: crafted step-file lines, records and step indexes; typed errors naming
the line, and accepted lines keep their values."""

from __future__ import annotations

import json
import math
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
            ("2**63", [1, 2**63, 3]), ("2**64", [1, 2**64, 3]), ("10**400", [1, 10**400, 3]),
            ("-2**63-1", [1, -(2**63) - 1, 3]), ("1e400", [1, 1e400, 3]), ("string", "abc"),
            ("object", {"a": 1}), ("nested lists", [[1, 2], [3]]), ("bools", [True, False, True]),
            ("nulls", [None, None, None]), ("too short", [1]), ("empty", []),
            ("mixed", [1, "a", 2.5]), ("float 1.5", [1, 1.5, 2]),
        ]:  # fmt: skip
            lines.append((f"{key} {what}", rec(**{key: value})))
    for key in ("advantages", "inference_logprobs", "temperatures"):
        for bad in ("NaN", "Infinity", "-Infinity"):
            line = json.dumps({**GOOD, key: [0.0, 0.0, 0.0]}).encode()
            lines.append(
                (f"{key} {bad} on a loss token", line.replace(b"0.0]", bad.encode() + b"]"))
            )
    fixed = {"dtype": "uint8", "shape": [3, 2], "data": [1, 2, 3, 4, 5, 6]}
    for what, edit in [
        ("huge shape", {"shape": [3, 2**40]}), ("negative shape", {"shape": [-1, 2]}),
        ("shape string", {"shape": "x"}), ("dtype object", {"dtype": "object"}),
        ("dtype V8", {"dtype": "V8"}), ("dtype U3", {"dtype": "U3"}), ("dtype 5", {"dtype": 5}),
        ("dtype M8", {"dtype": "datetime64[s]"}), ("data nested", {"data": [[[1]] * 6]}),
        ("data strings", {"data": ["a"] * 6}), ("data 2**70", {"data": [2**70] * 6}),
        ("no data", {"data": None}), ("shape of 40 dims", {"shape": [1] * 40, "data": [1]}),
        ("wide shape", {"shape": [3, 2**20], "data": [1, 2, 3, 4, 5, 6]}),
    ]:  # fmt: skip
        lines.append(
            (f"inline routed_experts {what}", rec(fields={"routed_experts": {**fixed, **edit}}))
        )
    ragged = {"counts": [0, 1, 1], "values": [5, 6]}
    for what, edit in [
        ("counts 2**40", {"counts": [0, 2**40, 1]}), ("counts 2**63", {"counts": [0, 2**63, 1]}),
        ("negative counts", {"counts": [0, -1, 1]}), ("counts floats", {"counts": [0, 1.5, 1]}),
        ("values 2**40", {"values": [5, 2**40]}), ("values strings", {"values": ["a", "b"]}),
        ("values nested", {"values": [[5], [6]]}), ("no values", {"values": None}),
        ("counts object", {"counts": {"a": 1}}),
    ]:  # fmt: skip
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
        ("zero rows, huge row shape", {}), ("rows 2**62", {"rows": 2**62, "shape": [2, 3]}),
        ("first 2**62-1", {"rows": 3, "first": 2**62 - 1, "dtype": "uint8", "shape": [2, 3]}),
        ("shape [2**31, 2**31]", {"shape": [2**31, 2**31]}), ("offset true", {"offset": True}),
        ("file ../x", {"file": "../outside/g/a.rfp", "rows": 3, "dtype": "uint8", "shape": [2, 3]}),
    ]:  # fmt: skip
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
    """Crafted lines: ``Sample.from_json``, ``parse_sample``, whole step files and step indexes
    raise typed errors; an accepted line holds exactly its JSON values, and goes through
    ``prepare_batch`` and ``to_tensor_micro_batch`` with typed errors only (non-finite
    advantages or logprobs on loss-bearing tokens must be refused on the way)."""
    from rollfeed.collate import PlanConfig, Sample, prepare_batch, to_tensor_micro_batch
    from rollfeed.loaders.step_files import read_step_file
    from rollfeed.loaders.step_index import build_step_index, parse_sample, read_step_index

    corpus = build_corpus(workdir, rng)
    good = json.dumps(GOOD).encode()
    for j, (what, line) in enumerate(crafted_lines()):
        try:
            data = json.loads(line)
        except (ValueError, RecursionError):
            data = None

        def through(sample, data=data):
            """Accepted: holds its JSON values exactly, then the collate pipeline."""
            ids = data.get("token_ids") if isinstance(data, dict) else None
            if isinstance(ids, list) and sample.token_ids.tolist() != ids:
                raise Wrong(f"token_ids {data['token_ids']} became {sample.token_ids.tolist()}")
            plan = prepare_batch([sample], PlanConfig(seq_len=64), dp_size=1)
            for mb in plan[0]:
                to_tensor_micro_batch(mb, cp_rank=0, root=corpus.root)
            if _loss_bearing_nonfinite(data):
                raise Wrong("a non-finite advantage or logprob on a loss-bearing token passed")

        if data is not None:
            tally.case(
                f"steps: Sample.from_json {what}",
                lambda line=line, f=through: f(Sample.from_json(line)),
            )
        tally.case(
            f"steps: parse_sample {what}",
            lambda line=line, f=through: f(parse_sample(line, file="s.jsonl", line_number=3)),
        )
        path = workdir / f"s{j}" / "step_000001.jsonl"
        path.parent.mkdir()
        path.write_bytes(b"\n".join([good, good, line, good]) + b"\n")

        def whole(path=path, what=what):
            from rollfeed.loaders.errors import StepFileError

            try:
                samples = read_step_file(path)
            except StepFileError as err:
                if err.line != 3:
                    raise Wrong(f"the error names line {err.line}, the crafted line is 3") from None
                raise
            if len(samples) != 4:
                raise Wrong(f"{len(samples)} samples from a file of 4 lines ({what})")

        tally.case(f"steps: read_step_file with {what} at line 3", whole)
        tally.case(
            f"steps: build_step_index with {what} at line 3",
            lambda path=path: build_step_index(path),
        )
    step = workdir / "idx" / "step_000001.jsonl"
    step.parent.mkdir()
    step.write_bytes(b"\n".join([good] * 3) + b"\n")
    size = step.stat().st_size
    ok = {
        "format": "rollfeed.step_index",
        "version": 2,
        "file_bytes": size,
        "lengths": [3] * 3,
        "offsets": [0, size // 3, 2 * size // 3],
        "sizes": [size // 3] * 3,
        "lines": [1, 2, 3],
        "crc32c": [crc32c.crc32c(good + b"\n")] * 3,
        "loss_runs": [1] * 3,  # GOOD's loss_mask [0, 1, 1]: the run [1, 3)
        "loss_spans": [1, 3] * 3,
    }
    for what, text in [
        ("list", b"[1, 2]"), ("deep nesting", b"[" * 100_000 + b"]" * 100_000),
        ("huge ints", json.dumps({**ok, "lengths": [2**70] * 3}).encode()),
        ("floats", json.dumps({**ok, "offsets": [0.5, 1.5, 2.5]}).encode()),
        ("nested arrays", json.dumps({**ok, "lines": [[1], [2], [3]]}).encode()),
        ("strings", json.dumps({**ok, "sizes": "abc"}).encode()),
        ("file_bytes 1e400", json.dumps({**ok, "file_bytes": 1e400}).encode()),
        ("file_bytes NaN", json.dumps({**ok, "file_bytes": float("nan")}).encode()),
        ("null arrays", json.dumps({**ok, "lengths": None}).encode()),
        ("crc32c missing", json.dumps({k: v for k, v in ok.items() if k != "crc32c"}).encode()),
        ("crc32c strings", json.dumps({**ok, "crc32c": ["a", "b", "c"]}).encode()),
        ("loss_spans odd", json.dumps({**ok, "loss_spans": [1, 3, 1, 3, 1]}).encode()),
        ("loss_runs huge", json.dumps({**ok, "loss_runs": [2**61] * 3}).encode()),
        ("invalid UTF-8", b'{"format": "\xff"}'),
    ]:  # fmt: skip
        ipath = step.with_name("step_000001.index.json")
        ipath.write_bytes(text)
        tally.case(f"steps: step index {what}", lambda: read_step_index(step))
