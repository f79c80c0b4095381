"""Turning user columns (tensors, jagged tensors, lists) into stored bytes and back (client side)."""

from __future__ import annotations

import functools
import reprlib
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack
import numpy as np
import torch

from .errors import InvalidRequestError, SchemaConflictError
from .jagged import JaggedTensor
from .schema import DTYPES, JAGGED, OBJECT, TENSOR, FieldSchema

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}
# Same-size unsigned ints: copies and pad fills work on raw bits, whatever the dtype.
BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclass
class EncodedColumn:
    """A column ready to store: schema, per-row byte offsets and the byte chunks in row order."""

    schema: FieldSchema
    row_offsets: np.ndarray  # int64 [n + 1]
    chunks: list[np.ndarray]  # uint8 arrays; their concatenation is the column's bytes
    lengths: np.ndarray | None = None  # leading-dim lengths of a jagged column

    @property
    def nbytes(self) -> int:
        return int(self.row_offsets[-1])


def _check_storable(t: torch.Tensor, field: str) -> None:
    """Only dense tensors holding data can be stored: say so, naming the field, before anything else
    (torch would fail later with NotImplementedError or RuntimeError)."""
    if t.layout != torch.strided:
        raise InvalidRequestError(f"field {field!r}: {t.layout} tensors cannot be stored; pass a dense tensor (.to_dense())")
    if t.device.type == "meta":
        raise InvalidRequestError(f"field {field!r}: a tensor on the meta device has no data to store")


def _dtype_name(t: torch.Tensor, field: str) -> str:
    _check_storable(t, field)
    name = DTYPE_NAMES.get(t.dtype)
    if name is None:
        raise InvalidRequestError(f"field {field!r}: dtype {t.dtype} is not supported; use one of {sorted(DTYPES)}")
    return name


def _raw(t: torch.Tensor) -> np.ndarray:
    """The bytes of a tensor as a uint8 numpy array (a view when already contiguous on CPU)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8).numpy() if t.numel() else np.empty(0, dtype=np.uint8)


def _offsets(lengths: np.ndarray, unit: int) -> np.ndarray:
    ro = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths * unit, out=ro[1:])
    return ro


def _from_numpy(field: str, value: np.ndarray) -> torch.Tensor | list:
    """A numpy column as a tensor (numbers) or as a list of per-sample objects (a 1-D array of
    objects, str or bytes: verl's ``non_tensor_batch`` form); what torch cannot hold is refused
    naming the field."""
    if value.dtype.kind in "OUS":
        if value.ndim != 1:
            raise InvalidRequestError(
                f"field {field!r}: a numpy array of {value.dtype} must be 1-D (one object per sample), got shape {value.shape}"
            )
        return value.tolist()
    try:
        return torch.from_numpy(np.ascontiguousarray(value))
    except TypeError:
        raise InvalidRequestError(f"field {field!r}: numpy dtype {value.dtype} is not supported; use one of {sorted(DTYPES)}") from None


def encode_column(field: str, value: Any, n_rows: int) -> EncodedColumn:
    """Encode one column of ``n_rows`` samples (see :meth:`TQClient.put` for accepted forms)."""
    if isinstance(value, np.ndarray):
        value = _from_numpy(field, value)
    if isinstance(value, torch.Tensor) and value.is_nested:
        if value.layout == torch.jagged:
            value = JaggedTensor(value.values(), value.offsets().to(torch.int64).cpu())
        else:  # torch's default (strided) nested layout has no offsets: its rows, as a list of tensors
            value = list(value.unbind())
    if isinstance(value, JaggedTensor):
        if len(value) != n_rows:
            raise InvalidRequestError(f"field {field!r} has {len(value)} rows for {n_rows} keys")
        schema = _jagged_schema(field, value.values)
        lengths = value.lengths.numpy()
        return EncodedColumn(schema, _offsets(lengths, schema.itemsize * schema.row_elems), [_raw(value.values)], lengths)
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or value.shape[0] != n_rows:
            raise InvalidRequestError(f"field {field!r}: tensor of shape {tuple(value.shape)} needs leading dim {n_rows}")
        schema = FieldSchema(TENSOR, _dtype_name(value, field), tuple(value.shape[1:]))
        row = schema.itemsize * schema.row_elems
        return EncodedColumn(schema, np.arange(n_rows + 1, dtype=np.int64) * row, [_raw(value)])
    if not isinstance(value, (list, tuple)):
        raise InvalidRequestError(f"field {field!r}: expected a tensor, JaggedTensor, nested tensor or list, got {type(value).__name__}")
    if len(value) != n_rows:
        raise InvalidRequestError(f"field {field!r} has {len(value)} rows for {n_rows} keys")
    if value and all(isinstance(v, torch.Tensor) for v in value):
        first = value[0]
        dtype, trailing = first.dtype, tuple(first.shape[1:])
        for i, v in enumerate(value):  # every row as row 0: torch.stack would promote an int row to float
            _check_storable(v, field)
            if v.dtype != dtype or (v.dim() == 0) != (first.dim() == 0) or tuple(v.shape[1:]) != trailing:
                raise SchemaConflictError(f"field {field!r}: row {i} is {v.dtype}{tuple(v.shape)}, row 0 is {dtype}{tuple(first.shape)}")
        if first.dim() == 0:  # scalars, one a sample
            return encode_column(field, torch.stack(list(value)), n_rows)
        schema = _jagged_schema(field, first)
        lengths = np.fromiter((v.shape[0] for v in value), dtype=np.int64, count=n_rows)
        return EncodedColumn(schema, _offsets(lengths, schema.itemsize * schema.row_elems), [_raw(v) for v in value], lengths)
    try:
        blobs = [msgpack.packb(v, use_bin_type=True) for v in value]
    except (TypeError, ValueError, OverflowError) as exc:  # OverflowError: an int past 64 bits
        raise InvalidRequestError(f"field {field!r}: values must be tensors or msgpack-able Python objects ({exc})") from None
    sizes = np.fromiter((len(b) for b in blobs), dtype=np.int64, count=n_rows)
    return EncodedColumn(FieldSchema(OBJECT, "object"), _offsets(sizes, 1), [np.frombuffer(b, dtype=np.uint8) for b in blobs])


def _jagged_schema(field: str, values: torch.Tensor) -> FieldSchema:
    """The schema of a jagged field whose entries are ``values``' rows; InvalidRequestError for entries
    of no bytes (a trailing dim of 0): a row's length is read back as its bytes over an entry's bytes."""
    schema = FieldSchema(JAGGED, _dtype_name(values, field), tuple(values.shape[1:]))
    if schema.row_elems == 0:
        raise InvalidRequestError(
            f"field {field!r}: jagged rows of shape (length, {', '.join(map(str, schema.shape))}) hold no bytes, so their lengths "
            "cannot be stored; drop the empty dimension or store the lengths as a column"
        )
    return schema


def pad_number(value: Any, what: str) -> float | int | bool:
    """A pad value as a Python number (a numpy scalar or one-element tensor - as a tokenizer may hand
    out its pad id - as its item); InvalidRequestError naming ``what`` for anything else."""
    if isinstance(value, np.generic) or isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, (bool, int, float)):
        raise InvalidRequestError(f"{what} {reprlib.repr(value)} is not a number (a bool, int or float)")
    return value


def pad_bits(schema: FieldSchema, pad_value: float | int | bool) -> Any:
    """The pad value (a number) as the raw bits of the field's dtype (so fills work for bfloat16 too);
    InvalidRequestError for one the dtype cannot hold (torch's own errors named neither)."""
    try:
        t = torch.tensor(pad_value, dtype=TORCH_DTYPES[schema.dtype])
    except (RuntimeError, OverflowError, ValueError):
        raise InvalidRequestError(f"pad value {pad_value!r} does not fit a {schema.dtype} field") from None
    return t.reshape(1).view(torch.uint8).numpy().view(BITS[schema.itemsize])[0]


@functools.lru_cache(maxsize=256, typed=True)
def pad_bytes(schema: FieldSchema, pad_value: float | int | bool) -> bytes:
    """:func:`pad_bits` as bytes, cached: every padded get of a field asks for the same few."""
    return pad_bits(schema, pad_value).tobytes()


def to_tensor(raw: np.ndarray, schema: FieldSchema, shape: tuple[int, ...]) -> torch.Tensor:
    """View raw bytes as a tensor of the field's dtype and ``shape`` (no copy)."""
    if not raw.size:
        return torch.empty(0, dtype=torch.uint8).view(TORCH_DTYPES[schema.dtype]).reshape(shape)
    if schema.dtype == "bfloat16":  # no numpy dtype: view the bits in torch
        return torch.from_numpy(raw).view(torch.bfloat16).reshape(shape)
    return torch.from_numpy(raw.view(DTYPES[schema.dtype][1]).reshape(shape))  # one torch call, not three


class FieldLayout(NamedTuple):
    """What a get needs of a field's schema, worked out once per schema (see :func:`field_layout`)."""

    schema: FieldSchema
    kind: str
    row_bytes: int  # bytes per sample (tensor), per token (jagged), 1 (object)
    bits: np.dtype  # the numpy dtype a result is viewed as (uint16 for bfloat16)
    bfloat16: bool
    shape: tuple[int, ...]  # the per-sample (tensor) or per-token (jagged) shape
    pads: dict  # pad value -> pad bytes, filled as gets ask

    def pad(self, value: float | int | bool) -> bytes:
        """:func:`pad_bytes` for this field's schema, from a per-schema cache (no hashing of the schema)."""
        got = self.pads.get(value)
        if got is None:
            got = pad_bytes(self.schema, value)
            if len(self.pads) < 16:  # a few distinct values at most (and NaNs never compare equal)
                self.pads[value] = got
        return got


_LAYOUTS: dict[int, tuple[FieldSchema, FieldLayout]] = {}


def field_layout(schema: FieldSchema) -> FieldLayout:
    """The schema's :class:`FieldLayout`, cached by the schema object's identity: a get looks up every
    field's, and schemas decoded from the wire are shared objects (``FieldSchema.from_wire``)."""
    hit = _LAYOUTS.get(id(schema))
    if hit is not None and hit[0] is schema:
        return hit[1]
    if len(_LAYOUTS) >= 4096:  # the cache holds its schemas alive, so ids are not reused while cached
        _LAYOUTS.clear()
    bits = DTYPES[schema.dtype][1] if schema.kind != OBJECT else np.dtype(np.uint8)
    layout = FieldLayout(
        schema, schema.kind, max(schema.itemsize * schema.row_elems, 1), bits, schema.dtype == "bfloat16", tuple(schema.shape), {}
    )
    _LAYOUTS[id(schema)] = (schema, layout)
    return layout


def tensor_at(raw: np.ndarray, start: int, layout: FieldLayout, shape: tuple[int, ...]) -> torch.Tensor:
    """View the bytes of ``raw`` from ``start`` as a tensor of the field's dtype and ``shape`` (no
    copy; one numpy constructor and one torch call: it runs for every field of every get)."""
    t = torch.from_numpy(np.ndarray(shape, layout.bits, raw, start))
    return t.view(torch.bfloat16) if layout.bfloat16 else t


def tensor_in(base: torch.Tensor, start: int, nbytes: int, layout: FieldLayout, shape: tuple[int, ...]) -> torch.Tensor:
    """:func:`tensor_at` of ``base[start:start + nbytes]`` (a torch uint8 tensor): a view of ``base``
    itself, so torch knows the result's storage as its own (a page-locked buffer from torch's host
    allocator then stays reserved while a ``non_blocking`` copy out of it runs, as with
    ``Tensor.pin_memory``)."""
    return base[start : start + nbytes].view(TORCH_DTYPES[layout.schema.dtype]).view(shape)


def unpack_objects(raw: np.ndarray, sizes: np.ndarray) -> list[Any]:
    """Decode one msgpack value per row from concatenated bytes."""
    out, pos, buf = [], 0, raw.tobytes()
    for s in sizes.tolist():
        try:
            out.append(msgpack.unpackb(buf[pos : pos + s], raw=False, strict_map_key=False))
        except TypeError:  # a dict keyed by tuples: msgpack stored each key as an array
            out.append(msgpack.unpackb(buf[pos : pos + s], raw=False, strict_map_key=False, object_pairs_hook=_dict_of_pairs))
        pos += s
    return out


def _dict_of_pairs(pairs: list[tuple[Any, Any]]) -> dict:
    """A decoded map whose array keys are made tuples again - the hashable form they were put as."""
    return {_as_key(k): v for k, v in pairs}


def _as_key(value: Any) -> Any:
    return tuple(map(_as_key, value)) if isinstance(value, list) else value
