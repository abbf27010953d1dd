"""Sample: one rollout branch as one flat token sequence, as an orchestrator sends it.

Per-token arrays are ``[T]``: ``token_ids`` (int64), ``loss_mask`` (bool), ``advantages``,
``inference_logprobs`` and ``temperatures`` (float32; ``None`` temperatures mean 1.0). Entry ``t``
describes token ``t`` itself (the training tensors shift to label coordinates later, see
:mod:`rollfeed.collate.tensor_batch`).

Payload fields (names from the fields registry) come inline or by handle, never both:

- ``fields[name]``: fixed width ``[T, *shape]`` (every position has a row: put the field's fill
  where there is no data) or ragged ``(counts[T], values[sum(counts)])`` (count 0 = no row);
- ``payload``: :class:`~rollfeed.payload.PayloadSegment` records with positions in ``[0, T]``
  (a zero-row placeholder may sit at ``pos == T``).

Worked example (3 tokens, the last two sampled, a mask kept set of 2 and 1 ids)::

    Sample([11, 12, 13], [0, 1, 1], [0.0, 0.5, 0.5], [0.0, -0.7, -0.1],
           fields={"sampling_mask": ([0, 2, 1], [12, 40, 13])})

JSON (``to_json``/``from_json``): per-token arrays as lists; a fixed field as
``{"dtype": "uint8", "shape": [T, L, K], "data": [flat]}``; a ragged field as
``{"counts": [...], "values": [...]}``; ``payload`` as a list of segment records.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any

import numpy as np

from rollfeed.collate.errors import (
    DuplicateFieldError,
    SampleDtypeError,
    SampleLengthError,
    SegmentRangeError,
)
from rollfeed.payload import PAYLOAD_FIELDS, PayloadField, PayloadSegment

Ragged = tuple[np.ndarray, np.ndarray]
FieldData = np.ndarray | Ragged


def _vector(name: str, value: Any, kinds: str, dtype: str, uid: str | None) -> np.ndarray:
    arr = np.asarray(value)
    if arr.size == 0 and arr.dtype.kind == "f" and "i" in kinds:
        arr = arr.astype(np.int64)  # an empty JSON list parses as float64
    if arr.ndim != 1:
        raise SampleDtypeError(f"{name} must be 1-D, got shape {arr.shape}", sample=uid, field=name)
    if arr.dtype.kind not in kinds:
        raise SampleDtypeError(
            f"{name} must have dtype kind in {kinds!r}, got {arr.dtype}", sample=uid, field=name
        )
    return np.ascontiguousarray(arr, dtype=dtype)


@dataclass(frozen=True, slots=True, eq=False)
class Sample:
    """One rollout branch; arrays validated for length and dtype on construction (see module)."""

    token_ids: np.ndarray
    loss_mask: np.ndarray
    advantages: np.ndarray
    inference_logprobs: np.ndarray
    _: KW_ONLY
    temperatures: np.ndarray | None = None
    fields: Mapping[str, FieldData] | None = None
    payload: Sequence[PayloadSegment] | None = None
    uid: str | None = None

    def __post_init__(self) -> None:
        uid, put = self.uid, object.__setattr__
        put(self, "token_ids", _vector("token_ids", self.token_ids, "iu", "int64", uid))
        T = len(self.token_ids)
        if T < 1:
            raise SampleLengthError("a sample needs at least one token", sample=uid)
        mask = np.asarray(self.loss_mask)
        if mask.dtype.kind != "b":
            mask = _vector("loss_mask", mask, "iuf", "float64", uid)
            if not np.isin(mask, (0.0, 1.0)).all():
                raise SampleDtypeError("loss_mask must hold 0/1", sample=uid, field="loss_mask")
        put(self, "loss_mask", _vector("loss_mask", mask, "biuf", "bool", uid))
        for name in ("advantages", "inference_logprobs", "temperatures"):
            value = getattr(self, name)
            if value is not None:
                put(self, name, _vector(name, value, "iuf", "float32", uid))
        for name in ("loss_mask", "advantages", "inference_logprobs", "temperatures"):
            value = getattr(self, name)
            if value is not None and len(value) != T:
                raise SampleLengthError(
                    f"{name} has {len(value)} entries, token_ids has {T}; give one per token",
                    sample=uid,
                    field=name,
                )
        put(self, "fields", {k: _field(k, v, T, uid) for k, v in (self.fields or {}).items()})
        segs = tuple(self.payload or ())
        for s in segs:
            if not isinstance(s, PayloadSegment):
                raise SampleDtypeError(
                    f"payload entries must be PayloadSegment, got {type(s).__name__}", sample=uid
                )
            if s.pos < 0 or s.rows < 0 or s.end > T:
                raise SegmentRangeError(
                    f"segment rows [{s.pos}, {s.end}) lie outside the sample's [0, {T}); "
                    "give positions relative to this sample's token_ids",
                    sample=uid,
                    field=s.field,
                    pos=s.pos,
                )
            if s.field in self.fields:
                raise DuplicateFieldError(
                    "field given both inline and by handle; send one or the other",
                    sample=uid,
                    field=s.field,
                )
        put(self, "payload", segs)

    def __len__(self) -> int:
        return len(self.token_ids)

    def check_fields(
        self, fields: Mapping[str, PayloadField] = PAYLOAD_FIELDS, *, index: int | None = None
    ) -> None:
        """Check inline fields and segments against a registry (known name, ragged-ness, kind)."""
        who = index if index is not None else self.uid
        names = [*self.fields, *(s.field for s in self.payload)]
        for name in names:
            if name not in fields:
                raise SampleDtypeError(
                    f"unknown payload field; known: {sorted(fields)}", sample=who, field=name
                )
        for name, data in self.fields.items():
            spec = fields[name]
            if spec.ragged != isinstance(data, tuple):
                want = "(counts, values)" if spec.ragged else "an array [T, *shape]"
                raise SampleDtypeError(f"field must be given as {want}", sample=who, field=name)
            values = data[1] if isinstance(data, tuple) else data
            if values.size and spec.is_int != (values.dtype.kind in "iu"):
                raise SampleDtypeError(
                    f"field holds {'int' if spec.is_int else 'float'} values, got {values.dtype}",
                    sample=who,
                    field=name,
                )
            if not spec.ragged and spec.is_int and not _holds(values.dtype, int(spec.fill)):
                raise SampleDtypeError(
                    f"dtype {values.dtype} cannot hold the fill {spec.fill}; widen the array",
                    sample=who,
                    field=name,
                )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "token_ids": self.token_ids.tolist(),
            "loss_mask": self.loss_mask.astype(np.int8).tolist(),
            "advantages": self.advantages.tolist(),
            "inference_logprobs": self.inference_logprobs.tolist(),
        }
        if self.temperatures is not None:
            out["temperatures"] = self.temperatures.tolist()
        if self.fields:
            out["fields"] = {
                k: {"counts": v[0].tolist(), "values": v[1].tolist()}
                if isinstance(v, tuple)
                else {"dtype": v.dtype.name, "shape": list(v.shape), "data": v.ravel().tolist()}
                for k, v in self.fields.items()
            }
        if self.payload:
            out["payload"] = [s.model_dump(mode="json") for s in self.payload]
        if self.uid is not None:
            out["uid"] = self.uid
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Sample:
        uid = data.get("uid")
        extra = set(data) - {*_KEYS, "fields", "payload", "uid", "temperatures"}
        missing = [k for k in _KEYS if k not in data]
        if extra or missing:
            raise SampleDtypeError(
                f"sample record has unknown keys {sorted(extra)} / lacks {missing}", sample=uid
            )
        fields = {}
        for name, rec in (data.get("fields") or {}).items():
            if "counts" in rec:
                fields[name] = (np.asarray(rec["counts"]), np.asarray(rec["values"]))
            else:
                try:
                    arr = np.asarray(rec["data"], dtype=rec["dtype"]).reshape(rec["shape"])
                except (KeyError, TypeError, ValueError) as err:
                    raise SampleDtypeError(
                        f"malformed inline field record: {err}", sample=uid, field=name
                    ) from None
                fields[name] = arr
        payload = [PayloadSegment.model_validate(s) for s in data.get("payload") or ()]
        return cls(
            *(data[k] for k in _KEYS),
            temperatures=data.get("temperatures"),
            fields=fields,
            payload=payload,
            uid=uid,
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Sample:
        return cls.from_dict(json.loads(text))


_KEYS = ("token_ids", "loss_mask", "advantages", "inference_logprobs")


def _holds(dtype: np.dtype, value: int) -> bool:
    info = np.iinfo(dtype)
    return info.min <= value <= info.max


def _field(name: str, data: Any, T: int, uid: str | None) -> FieldData:
    if isinstance(data, tuple | list) and len(data) == 2 and not isinstance(data[0], int | float):
        counts = _vector(f"{name} counts", data[0], "iu", "int64", uid)
        values = np.asarray(data[1])
        if values.size == 0 and values.dtype.kind == "f":
            values = values.astype(np.int64)  # an empty JSON list parses as float64
        if len(counts) != T:
            raise SampleLengthError(
                f"ragged field has {len(counts)} row counts for {T} tokens", sample=uid, field=name
            )
        if (counts < 0).any():
            pos = int(np.argmax(counts < 0))
            raise SampleLengthError("negative row count", sample=uid, field=name, pos=pos)
        if values.ndim != 1 or len(values) != int(counts.sum()):
            raise SampleLengthError(
                f"ragged field needs {int(counts.sum())} values (sum of counts), got "
                f"shape {values.shape}",
                sample=uid,
                field=name,
            )
        if values.dtype.kind not in "iuf":
            raise SampleDtypeError(f"values of dtype {values.dtype}", sample=uid, field=name)
        if (
            values.dtype.kind in "iu"
            and values.size
            and not (
                _holds(np.dtype(np.int32), int(values.min()))
                and _holds(np.dtype(np.int32), int(values.max()))
            )
        ):
            raise SampleDtypeError(
                "ragged integer values must fit int32 (they are read back as int32)",
                sample=uid,
                field=name,
            )
        return counts, np.ascontiguousarray(values)
    arr = np.asarray(data)
    if arr.ndim < 1 or arr.shape[0] != T:
        raise SampleLengthError(
            f"fixed-width field has shape {arr.shape}, needs [T={T}, ...]", sample=uid, field=name
        )
    if arr.dtype.kind not in "iuf":
        raise SampleDtypeError(f"field of dtype {arr.dtype}", sample=uid, field=name)
    return np.ascontiguousarray(arr)
