"""Sample: one rollout branch as one flat token sequence, as an orchestrator sends it.

Per-token arrays are ``[T]``: ``token_ids`` (int64, the one positional argument), then by
keyword only ``loss_mask`` (bool), ``advantages``, ``inference_logprobs`` and ``temperatures``
(float32; ``None`` temperatures mean 1.0): arrays of one shape are never told apart by position.
Entry ``t`` describes token ``t`` itself (the training tensors shift to label coordinates later,
see :mod:`rollfeed.collate.tensor_batch`).

Payload fields (names from the fields registry) come inline or by handle, never both:

- ``fields[name]``: fixed width ``[R, *shape]``, ``R <= T``: rows for positions ``0 .. R - 1``,
  the positions after them have no row (they read as fill and are not covered, e.g. routing
  ``[T - 1, L, K]``: the final sampled token is never forwarded), or ragged
  ``(counts[T], values[sum(counts)])`` (count 0 = no row);
- ``payload``: :class:`~rollfeed.payload.PayloadSegment` records with positions in ``[0, T]``
  (a zero-row placeholder may sit at ``pos == T``).

Images (``images``): :class:`~rollfeed.payload.ImageSpan` records in token order, each tied to
its run of placeholder tokens ``[start, start + tokens)`` inside ``[0, T)`` (runs may touch, never
overlap), the encoded bytes by handle (``media``, stored once under the payload root) or inline.
Several per sample, several per conversation: each turn's images where its tokens are.

Policy versions (``version_spans``): ``[K, 3]`` int64 rows ``(start, end, version)``, the trainer
step whose weights sampled tokens ``[start, end)`` (:mod:`rollfeed.collate.versions`: spans in
token order, apart, inside the sample and past token 0; ``None`` or empty: no token carries one).
A rollout continued across a weight update holds a span per version.

Worked example (3 tokens, the last two sampled, a mask kept set of 2 and 1 ids)::

    Sample([11, 12, 13], loss_mask=[0, 1, 1], advantages=[0.0, 0.5, 0.5],
           inference_logprobs=[0.0, -0.7, -0.1],
           fields={"sampling_mask": ([0, 2, 1], [12, 40, 13])})

Validation on construction (typed :mod:`rollfeed.collate.errors` naming sample, field and
position): lengths and dtypes; token ids >= 0; ``advantages`` and ``inference_logprobs`` finite and
``temperatures`` finite and > 0 wherever ``loss_mask`` is 1 (elsewhere any value: those tokens
bear no loss); no size a record claims exceeds the data it carries, checked before an array is
made (an inline dtype is a stored dtype name, a shape holds exactly its data, a ragged row count
is at most the values given); a field's fixed-width segments claim one row shape.

JSON (``to_json``/``from_json``): per-token arrays as lists; ``version_spans`` as a list of
``[start, end, version]`` triples; a fixed field as
``{"dtype": "uint8", "shape": [T, L, K], "data": [flat]}``; a ragged field as
``{"counts": [...], "values": [...]}``; ``payload`` as a list of segment records; ``images`` as
a list of image records (inline bytes in base64).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any

import numpy as np
from pydantic import ValidationError

from rollfeed.collate.errors import (
    DuplicateFieldError,
    SampleDtypeError,
    SampleLengthError,
    SampleValueError,
    SegmentRangeError,
)
from rollfeed.collate.versions import check_version_spans
from rollfeed.payload import PAYLOAD_FIELDS, ImageSpan, PayloadField, PayloadSegment
from rollfeed.payload.errors import PayloadMediaError
from rollfeed.payload.segment import STORED_DTYPES

Ragged = tuple[np.ndarray, np.ndarray]
FieldData = np.ndarray | Ragged


def _array(name: str, value: Any, uid: str | None) -> np.ndarray:
    """``np.asarray(value)``; nested lists of uneven or excessive depth are a typed error."""
    try:
        return np.asarray(value)
    except ValueError as err:
        raise SampleDtypeError(f"{name} is not an array: {err}", sample=uid, field=name) from None


def _vector(name: str, value: Any, kinds: str, dtype: str, uid: str | None) -> np.ndarray:
    arr = _array(name, value, uid)
    if arr.size == 0 and arr.dtype.kind == "f" and "i" in kinds:
        arr = arr.astype(np.int64)  # an empty JSON list parses as float64
    if arr.ndim != 1:
        raise SampleDtypeError(f"{name} must be 1-D, got shape {arr.shape}", sample=uid, field=name)
    if arr.dtype.kind not in kinds:
        raise SampleDtypeError(
            f"{name} must have dtype kind in {kinds!r}, got {arr.dtype}", sample=uid, field=name
        )
    want = np.dtype(dtype)
    # e.g. uint64 ids >= 2**63 would wrap negative in int64
    unsafe = want.kind == "i" and arr.dtype.kind in "iu" and not np.can_cast(arr.dtype, want)
    if unsafe and not _fits(arr, want):
        raise SampleValueError(
            f"{name} holds integers outside {dtype}'s range", sample=uid, field=name
        )
    with np.errstate(over="ignore"):  # a float beyond float32 becomes inf: _finite_on_loss
        return np.ascontiguousarray(arr, dtype=dtype)


def _fits(arr: np.ndarray, dtype: np.dtype) -> bool:
    """Whether every integer of ``arr`` is representable in the integer ``dtype``."""
    return not arr.size or (_holds(dtype, int(arr.min())) and _holds(dtype, int(arr.max())))


def _finite_on_loss(sample: Sample) -> None:
    """NaN/inf advantages or logprobs, or temperatures not finite and > 0, on loss-bearing
    tokens (``loss_mask`` 1) are refused, naming the first such position; elsewhere allowed.

    A finite sum means every value is finite (NaN and inf propagate), so the common case costs
    one reduction per array; a sum that overflowed only takes the exact per-token check."""
    for name in ("advantages", "inference_logprobs", "temperatures"):
        values = getattr(sample, name)
        if values is None:
            continue
        positive = name == "temperatures"
        if math.isfinite(values.sum()) and (not positive or values.min() > 0):
            continue
        good = (values > 0) & (values < np.inf) if positive else np.isfinite(values)
        bad = sample.loss_mask & ~good
        if bad.any():
            pos = int(np.argmax(bad))
            raise SampleValueError(
                f"{name}[{pos}] is {values[pos]} on a loss-bearing token; it must be "
                f"{'finite and > 0' if positive else 'finite'} where loss_mask is 1 (fix the "
                "value, or set loss_mask to 0 there)",
                sample=sample.uid,
                field=name,
                pos=pos,
            )


@dataclass(frozen=True, slots=True, eq=False)
class Sample:
    """One rollout branch; arrays validated for length and dtype on construction (see module)."""

    token_ids: np.ndarray
    _: KW_ONLY  # the per-token arrays look alike: name each (positional use is a TypeError)
    loss_mask: np.ndarray
    advantages: np.ndarray
    inference_logprobs: np.ndarray
    temperatures: np.ndarray | None = None
    fields: Mapping[str, FieldData] | None = None
    payload: Sequence[PayloadSegment] | None = None
    images: Sequence[ImageSpan] | None = None
    version_spans: np.ndarray | Sequence[Sequence[int]] | None = None  # [K, 3] int64 once made
    uid: str | None = None

    def __post_init__(self) -> None:
        uid, put = self.uid, object.__setattr__
        if uid is not None and not isinstance(uid, str):
            raise SampleDtypeError(f"uid must be a string or None, got {type(uid).__name__}")
        put(self, "token_ids", _vector("token_ids", self.token_ids, "iu", "int64", uid))
        T = len(self.token_ids)
        if T < 1:
            raise SampleLengthError("a sample needs at least one token", sample=uid)
        if self.token_ids.min() < 0:
            pos = int(np.argmax(self.token_ids < 0))
            raise SampleValueError(
                f"token id {int(self.token_ids[pos])} is negative",
                sample=uid,
                field="token_ids",
                pos=pos,
            )
        mask = _array("loss_mask", self.loss_mask, uid)
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
        _finite_on_loss(self)
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
        _check_row_shapes(segs, uid)
        put(self, "payload", segs)
        put(self, "images", _check_images(self.images, T, uid))
        put(self, "version_spans", check_version_spans(self.version_spans, T, uid))

    def __len__(self) -> int:
        return len(self.token_ids)

    def check_fields(
        self, fields: Mapping[str, PayloadField] = PAYLOAD_FIELDS, *, index: int | None = None
    ) -> None:
        """Check inline fields and segments against a registry (known name, ragged-ness, kind)."""
        who = index if index is not None else self.uid
        for name in itertools.chain(self.fields, [s.field for s in self.payload]):
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
        if self.images:
            out["images"] = [im.model_dump(mode="json") for im in self.images]
        if len(self.version_spans):
            out["version_spans"] = self.version_spans.tolist()
        if self.uid is not None:
            out["uid"] = self.uid
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Sample:
        """A sample from its JSON record; a malformed record is a :class:`CollateError` naming
        the part, raised before anything of the size the record claims is allocated."""
        if not isinstance(data, Mapping):
            raise SampleDtypeError(f"a sample record is a JSON object, got {type(data).__name__}")
        uid = data.get("uid")
        extra = set(data) - {*_KEYS, *_OPTIONAL}
        missing = [k for k in _KEYS if k not in data]
        if extra or missing:
            raise SampleDtypeError(
                f"sample record has unknown keys {sorted(extra)} / lacks {missing}", sample=uid
            )
        records = {} if data.get("fields") is None else data["fields"]
        if not isinstance(records, Mapping):
            raise SampleDtypeError(
                f"fields must be an object of field records, got {type(records).__name__}",
                sample=uid,
            )
        fields = {name: _field_record(name, rec, uid) for name, rec in records.items()}
        segments = [] if data.get("payload") is None else data["payload"]
        if not isinstance(segments, list):
            raise SampleDtypeError(
                f"payload must be a list of segment records, got {type(segments).__name__}",
                sample=uid,
            )
        payload = []
        for k, rec in enumerate(segments):
            try:
                payload.append(PayloadSegment.model_validate(rec))
            except ValidationError as err:
                raise SampleDtypeError(
                    f"payload[{k}] is not a segment record: {err}", sample=uid
                ) from None
        return cls(
            data["token_ids"],
            **{k: data[k] for k in _KEYS[1:]},
            temperatures=data.get("temperatures"),
            fields=fields,
            payload=payload,
            images=_image_records(data.get("images"), uid),
            version_spans=data.get("version_spans"),
            uid=uid,
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Sample:
        """:meth:`from_dict` of one JSON object; malformed text is a :class:`SampleDtypeError`."""
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as err:  # JSONDecodeError, UnicodeDecodeError
            raise SampleDtypeError(
                f"not a JSON sample record ({type(err).__name__}: {err})"
            ) from None
        return cls.from_dict(data)


_KEYS = ("token_ids", "loss_mask", "advantages", "inference_logprobs")
_OPTIONAL = ("fields", "payload", "images", "version_spans", "uid", "temperatures")


def _holds(dtype: np.dtype, value: int) -> bool:
    info = np.iinfo(dtype)
    return info.min <= value <= info.max


def _field_record(name: str, rec: Any, uid: str | None) -> FieldData:
    """One inline field's JSON record as arrays. A fixed-width record's dtype must be a stored
    dtype name and its shape must match its data, both checked before any array is made: the
    arrays are never larger than the data the record carries."""
    if isinstance(rec, Mapping) and set(rec) == {"counts", "values"}:
        return _array(f"{name} counts", rec["counts"], uid), _array(name, rec["values"], uid)
    if not isinstance(rec, Mapping) or set(rec) != {"dtype", "shape", "data"}:
        raise SampleDtypeError(
            "an inline field record is {counts, values} (ragged) or {dtype, shape, data} "
            f"(fixed width), got {rec if not isinstance(rec, Mapping) else sorted(rec)!r:.80}",
            sample=uid,
            field=name,
        )
    dtype, shape, data = rec["dtype"], rec["shape"], rec["data"]
    if not isinstance(dtype, str) or dtype not in STORED_DTYPES:
        raise SampleDtypeError(
            f"inline dtype {dtype!r:.40} is not one of {sorted(STORED_DTYPES)}",
            sample=uid,
            field=name,
        )
    if not (
        isinstance(shape, list)
        and shape
        and all(type(d) is int and d >= 1 for d in shape)
        and isinstance(data, list)
        and math.prod(shape) == len(data)
    ):
        raise SampleLengthError(
            f"inline shape {shape!r:.80} (every dimension an int >= 1) does not hold the "
            f"{len(data) if isinstance(data, list) else 'non-list'} values of data",
            sample=uid,
            field=name,
        )
    arr, want = _array(name, data, uid), np.dtype(dtype)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in ("iu" if want.kind in "iu" else "iuf")):
        raise SampleDtypeError(
            f"inline data must be a flat list of {'integers' if want.kind in 'iu' else 'numbers'} "
            f"for dtype {dtype}",
            sample=uid,
            field=name,
        )
    if want.kind in "iu" and not _fits(arr, want):
        raise SampleValueError(
            f"inline data holds integers outside {dtype}'s range", sample=uid, field=name
        )
    return arr.astype(want).reshape(shape)


def _check_row_shapes(segs: tuple[PayloadSegment, ...], uid: str | None) -> None:
    """A field's fixed-width segments in one sample claim one row shape: a zero-row placeholder
    claiming a larger row than its field's rows would size the fill the collate path allocates."""
    shapes: dict[str, tuple[int, ...]] = {}
    for s in segs:
        if s.ragged is None and shapes.setdefault(s.field, s.shape) != s.shape:
            raise SampleDtypeError(
                f"segment row shape {list(s.shape)} differs from the shape "
                f"{list(shapes[s.field])} of another segment of this field in the sample",
                sample=uid,
                field=s.field,
                pos=s.pos,
            )


def _image_records(records: Any, uid: str | None) -> list[ImageSpan]:
    """The ``images`` of a JSON sample record, each a checked image record."""
    if records is None:
        return []
    if not isinstance(records, list):
        raise SampleDtypeError(
            f"images must be a list of image records, got {type(records).__name__}", sample=uid
        )
    out = []
    for k, rec in enumerate(records):
        try:
            out.append(ImageSpan.parse(rec))
        except PayloadMediaError as err:
            raise SampleDtypeError(
                f"images[{k}] is not an image record: {err}", sample=uid, field="images"
            ) from None
    return out


def _check_images(images: Any, T: int, uid: str | None) -> tuple[ImageSpan, ...]:
    """Image records in token order, each placeholder run inside the sample, none overlapping."""
    out = tuple(images or ())
    end = 0
    for k, im in enumerate(out):
        if not isinstance(im, ImageSpan):
            raise SampleDtypeError(
                f"images[{k}] must be an ImageSpan, got {type(im).__name__}",
                sample=uid,
                field="images",
            )
        if im.end > T:
            raise SegmentRangeError(
                f"images[{k}]'s placeholder run [{im.start}, {im.end}) lies outside the "
                f"sample's {T} tokens",
                sample=uid,
                field="images",
                pos=im.start,
            )
        if im.start < end:
            raise SampleValueError(
                f"images[{k}]'s placeholder run [{im.start}, {im.end}) starts before the run of "
                f"the image before it ends ({end}); give images in token order, runs apart",
                sample=uid,
                field="images",
                pos=im.start,
            )
        end = im.end
    return out


def _field(name: str, data: Any, T: int, uid: str | None) -> FieldData:
    if isinstance(data, tuple | list) and len(data) == 2 and not isinstance(data[0], int | float):
        counts = _vector(f"{name} counts", data[0], "iu", "int64", uid)
        values = _array(name, data[1], uid)
        if values.size == 0 and values.dtype.kind == "f":
            values = values.astype(np.int64)  # an empty JSON list parses as float64
        if len(counts) != T:
            raise SampleLengthError(
                f"ragged field has {len(counts)} row counts for {T} tokens", sample=uid, field=name
            )
        if (counts < 0).any():
            pos = int(np.argmax(counts < 0))
            raise SampleLengthError("negative row count", sample=uid, field=name, pos=pos)
        if values.ndim != 1:
            raise SampleLengthError(
                f"ragged values must be 1-D, got shape {values.shape}", sample=uid, field=name
            )
        if counts.size and int(counts.max()) > len(values):  # else the sum below could wrap
            pos = int(np.argmax(counts))
            raise SampleLengthError(
                f"a row claims {int(counts[pos])} values, more than the {len(values)} the field "
                "carries; give each row's count of values",
                sample=uid,
                field=name,
                pos=pos,
            )
        if len(values) != int(counts.sum()):
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
    arr = _array(name, data, uid)
    if arr.ndim < 1 or arr.shape[0] > T or 0 in arr.shape:
        raise SampleLengthError(
            f"fixed-width field has shape {arr.shape}, needs [R <= T={T}, ...] rows with no empty "
            "dimension",
            sample=uid,
            field=name,
        )
    if arr.dtype.name not in STORED_DTYPES:
        raise SampleDtypeError(
            f"field of dtype {arr.dtype}; use one of {sorted(STORED_DTYPES)}",
            sample=uid,
            field=name,
        )
    return np.ascontiguousarray(arr)
