"""OLMo-core's metadata models (``TensorShardSpec``, ``TensorStorageMetadata``,
``StorageMetadata``), name for name and field for field, as plain classes: built from keyword
data like the pydantic models they mirror, equal when their fields are, and dumped to the same
JSON (``json.dumps(m.model_dump())`` is the text OLMo-core writes to ``metadata.json``).

The metadata tessera hands out has been checked by the Rust core (bounds, tiling, files);
these classes only carry it and answer OLMo-core's questions about it.
"""

from __future__ import annotations

import enum
import json
from functools import reduce
from typing import Any, Dict, Generator, Iterable, Optional, Tuple

import torch

from .._core.dtypes import TESSERA_TO_TORCH_NAME, TESSERA_DTYPES, tessera_dtype_to_torch

__all__ = ["OverlapType", "TensorShardSpec", "TensorStorageMetadata", "StorageMetadata", "TORCH_DTYPES"]


def _olmo_name(tessera_name: str) -> str:
    """OLMo-core's (safetensors') spelling of a tessera element type: ``bf16`` -> ``BF16``."""
    return "F8_E4M3" if tessera_name == "f8_e4m3fn" else tessera_name.upper()


# OLMo-core's dtype names and the torch dtypes they stand for: the package's one dtype table,
# respelled (and only the types this torch has).
TORCH_DTYPES: Dict[str, torch.dtype] = {
    _olmo_name(n): tessera_dtype_to_torch(n) for n in TESSERA_DTYPES if hasattr(torch, TESSERA_TO_TORCH_NAME[n])
}
TORCH_DTYPE_TO_STR: Dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}


class OverlapType(str, enum.Enum):
    """How one shard covers another (OLMo-core's ``OverlapType``)."""

    EQUAL = "EQUAL"
    SUPERSET = "SUPERSET"
    SUBSET = "SUBSET"
    MIXED = "MIXED"

    def __str__(self) -> str:
        return self.value


def _ints(x: Any) -> Optional[Tuple[int, ...]]:
    return None if x is None else tuple(int(v) for v in x)


def _overlaps(a: Tuple[int, int], b: Tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _combine(results: set) -> Optional[OverlapType]:
    if not results:
        return None
    if len(results) == 1:
        return next(iter(results))
    if results == {OverlapType.EQUAL, OverlapType.SUPERSET}:
        return OverlapType.SUPERSET
    if results == {OverlapType.EQUAL, OverlapType.SUBSET}:
        return OverlapType.SUBSET
    return OverlapType.MIXED


def _relation(a: Tuple[int, int], b: Tuple[int, int]) -> Optional[OverlapType]:
    if a == b:
        return OverlapType.EQUAL
    if a[0] <= b[0] and b[1] <= a[1]:
        return OverlapType.SUPERSET
    if b[0] <= a[0] and a[1] <= b[1]:
        return OverlapType.SUBSET
    if _overlaps(a, b):
        return OverlapType.MIXED
    return None


class _Model:
    """What the three models share: keyword construction, field equality, dumps."""

    _fields: Tuple[str, ...] = ()

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and all(getattr(self, f) == getattr(other, f) for f in self._fields)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{f}={getattr(self, f)!r}' for f in self._fields)})"

    def model_dump_json(self) -> str:
        """The model as JSON text (OLMo-core writes ``json.dump(model_dump())``)."""
        return json.dumps(self.model_dump())

    @classmethod
    def model_validate(cls, data: Any) -> Any:
        """Builds the model from a dict (or returns an instance as is). Keys that are no field
        are ignored, as pydantic's models (OLMo-core's) ignore them."""
        if isinstance(data, cls):
            return data
        return cls(**{k: v for k, v in data.items() if k in cls._fields})

    @classmethod
    def model_validate_json(cls, text: str) -> Any:
        """Builds the model from JSON text."""
        return cls.model_validate(json.loads(text))

    def model_dump(self) -> Dict[str, Any]:  # pragma: no cover - every model overrides it
        raise NotImplementedError


class TensorShardSpec(_Model):
    """Where one file's (or rank's) shard lies in a tensor: ``flattened_offsets`` (ranges of
    the row-major flattening, stored back to back) or ``local_shape`` + ``global_offset``."""

    _fields = ("flattened_offsets", "local_shape", "global_offset")

    def __init__(
        self,
        flattened_offsets: Optional[Iterable[Iterable[int]]] = None,
        local_shape: Optional[Iterable[int]] = None,
        global_offset: Optional[Iterable[int]] = None,
    ) -> None:
        self.flattened_offsets: Optional[Tuple[Tuple[int, int], ...]] = (
            None if flattened_offsets is None else tuple((int(s), int(e)) for s, e in flattened_offsets)
        )
        self.local_shape: Optional[Tuple[int, ...]] = _ints(local_shape)
        self.global_offset: Optional[Tuple[int, ...]] = _ints(global_offset)

    def __hash__(self) -> int:
        return hash((self.flattened_offsets, self.local_shape, self.global_offset))

    def model_dump(self) -> Dict[str, Any]:
        return {
            "flattened_offsets": self.flattened_offsets,
            "local_shape": self.local_shape,
            "global_offset": self.global_offset,
        }

    @property
    def local_numel(self) -> int:
        """Elements the shard holds."""
        if self.local_shape is not None:
            return reduce(lambda x, y: x * y, self.local_shape, 1)
        if self.flattened_offsets is not None:
            return sum(e - s for s, e in self.flattened_offsets)
        raise ValueError("missing required fields to determine local numel")

    def get_flattened_offsets(self, full_shape: Tuple[int, ...]) -> Generator[Tuple[int, int], None, None]:
        """Ranges of the full tensor's flattening the shard holds, in storage order (computed
        from the box for a ``local_shape`` spec, for any number of axes)."""
        if self.flattened_offsets is not None:
            yield from self.flattened_offsets
            return
        if self.local_shape is None or self.global_offset is None:
            raise ValueError("missing required fields to produce flattened offsets")
        shape, off = tuple(full_shape), self.global_offset
        if not shape:
            yield (0, 1)
            return
        if self.local_numel == 0:
            return
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
        row = self.local_shape[-1]
        outer = self.local_shape[:-1]
        for r in range(reduce(lambda x, y: x * y, outer, 1)):
            start, rem = off[-1], r
            for i in range(len(outer) - 1, -1, -1):
                start += (off[i] + rem % outer[i]) * strides[i]
                rem //= outer[i]
            yield (start, start + row)

    def get_merged_flattened_offsets(self, full_shape: Tuple[int, ...]) -> Generator[Tuple[int, int], None, None]:
        """Like :meth:`get_flattened_offsets`, with contiguous ranges merged and empty ones
        dropped."""
        current: Optional[Tuple[int, int]] = None
        for s, e in self.get_flattened_offsets(full_shape):
            if s == e:
                continue
            if current is None:
                current = (s, e)
            elif current[1] == s:
                current = (current[0], e)
            else:
                yield current
                current = (s, e)
        if current is not None:
            yield current

    def compute_overlap_with(self, other: "TensorShardSpec", full_shape: Tuple[int, ...]) -> Optional[OverlapType]:
        """How this shard covers ``other`` (None: they share no element)."""
        if self == other:
            return OverlapType.EQUAL
        if self.flattened_offsets is not None or other.flattened_offsets is not None:
            results = set()
            for a in self.get_merged_flattened_offsets(full_shape):
                for b in other.get_merged_flattened_offsets(full_shape):
                    r = _relation(a, b)
                    if r is not None:
                        results.add(r)
            return _combine(results)
        if None not in (self.local_shape, self.global_offset, other.local_shape, other.global_offset):
            per_dim = set()
            for d in range(len(self.local_shape)):  # type: ignore[arg-type]
                a = (self.global_offset[d], self.global_offset[d] + self.local_shape[d])  # type: ignore[index]
                b = (other.global_offset[d], other.global_offset[d] + other.local_shape[d])  # type: ignore[index]
                per_dim.add(_relation(a, b))
            if None in per_dim:
                return None
            return _combine(per_dim)
        return OverlapType.MIXED


class TensorStorageMetadata(_Model):
    """One tensor of a checkpoint: full ``shape``, ``is_sharded``, ``dtype`` (OLMo-core's name,
    e.g. ``"F32"``) and ``shard_spec_per_file`` (file name → :class:`TensorShardSpec`)."""

    _fields = ("shape", "is_sharded", "dtype", "shard_spec_per_file")

    def __init__(
        self,
        shape: Iterable[int],
        is_sharded: bool,
        dtype: str,
        shard_spec_per_file: Dict[str, Any],
    ) -> None:
        self.shape: Tuple[int, ...] = tuple(int(d) for d in shape)
        self.is_sharded = bool(is_sharded)
        self.dtype = str(dtype)
        self.shard_spec_per_file: Dict[str, TensorShardSpec] = {
            str(f): TensorShardSpec.model_validate(s) for f, s in shard_spec_per_file.items()
        }

    def model_dump(self) -> Dict[str, Any]:
        return {
            "shape": self.shape,
            "is_sharded": self.is_sharded,
            "dtype": self.dtype,
            "shard_spec_per_file": {f: s.model_dump() for f, s in self.shard_spec_per_file.items()},
        }

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of :attr:`dtype`."""
        return TORCH_DTYPES[self.dtype]

    def materialize_empty(
        self, *, device: Optional[torch.device] = None, shape: Optional[Tuple[int, ...]] = None
    ) -> torch.Tensor:
        """An uninitialized tensor of the full shape (or ``shape``); floating ones hold NaN."""
        tensor = torch.empty(shape if shape is not None else self.shape, dtype=self.torch_dtype, device=device)
        if tensor.dtype.is_floating_point:
            tensor.fill_(torch.nan)
        return tensor

    def get_flattened_offsets_in_file(self, filename: str) -> Generator[Tuple[int, int], None, None]:
        """Ranges of the flattening that ``filename`` holds (none if it holds nothing)."""
        spec = self.shard_spec_per_file.get(filename)
        if spec is not None:
            yield from spec.get_flattened_offsets(self.shape)

    def get_numel_in_file(self, filename: str) -> int:
        """Elements ``filename`` holds."""
        spec = self.shard_spec_per_file.get(filename)
        return 0 if spec is None else spec.local_numel


class StorageMetadata(_Model):
    """A checkpoint's ``metadata.json``: ``tensors`` (key → :class:`TensorStorageMetadata`)."""

    _fields = ("tensors",)

    def __init__(self, tensors: Dict[str, Any]) -> None:
        self.tensors: Dict[str, TensorStorageMetadata] = {
            str(k): TensorStorageMetadata.model_validate(v) for k, v in tensors.items()
        }

    def model_dump(self) -> Dict[str, Any]:
        return {"tensors": {k: v.model_dump() for k, v in self.tensors.items()}}

    @classmethod
    def from_json(cls, text: str) -> "StorageMetadata":
        """From the text of a ``metadata.json``, including the layout before shard specs
        (``flattened_offsets_per_file``), which it reads as OLMo-core does. Keys other than
        ``tensors`` are ignored, as OLMo-core's pydantic model ignores them (tessera records the
        save of ``model/`` and ``optim/`` under ``tessera_save``)."""
        data = json.loads(text)
        for t in data.get("tensors", {}).values():
            legacy = t.pop("flattened_offsets_per_file", None)
            if legacy is not None:
                t["shard_spec_per_file"] = {
                    f: {"flattened_offsets": [o] if o and isinstance(o[0], int) else o} for f, o in legacy.items()
                }
        return cls.model_validate(data)
