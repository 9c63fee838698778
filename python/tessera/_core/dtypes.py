"""Element types: torch / numpy dtypes and the names the tessera format uses for them.

torch is optional: the tables are built on first use, and only from the dtypes the installed
torch version has (unsigned 16/32/64-bit types arrived in torch 2.3).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from ..errors import TesseraError

__all__ = [
    "TESSERA_DTYPES",
    "torch_dtype_to_tessera",
    "tessera_dtype_to_torch",
    "numpy_dtype_to_tessera",
    "tessera_dtype_to_numpy",
    "to_tessera_dtype",
]

# Every element type the format stores, by tessera name, with the torch attribute name.
TESSERA_TO_TORCH_NAME: Dict[str, str] = {
    "f64": "float64",
    "f32": "float32",
    "f16": "float16",
    "bf16": "bfloat16",
    "f8_e4m3fn": "float8_e4m3fn",
    "f8_e5m2": "float8_e5m2",
    "i64": "int64",
    "i32": "int32",
    "i16": "int16",
    "i8": "int8",
    "u8": "uint8",
    "u16": "uint16",
    "u32": "uint32",
    "u64": "uint64",
    "bool": "bool",
}

TESSERA_DTYPES = tuple(TESSERA_TO_TORCH_NAME)

# numpy has no bf16 or float8 types; those names have no numpy counterpart.
_TESSERA_TO_NUMPY_NAME: Dict[str, str] = {
    name: torch_name
    for name, torch_name in TESSERA_TO_TORCH_NAME.items()
    if name not in ("bf16", "f8_e4m3fn", "f8_e5m2")
}

_torch_tables: Optional[tuple] = None


def _tables() -> tuple:
    """(torch dtype -> tessera name, tessera name -> torch dtype), built once."""
    global _torch_tables
    if _torch_tables is None:
        import torch

        to_tessera: Dict[Any, str] = {}
        to_torch: Dict[str, Any] = {}
        for name, torch_name in TESSERA_TO_TORCH_NAME.items():
            dtype = getattr(torch, torch_name, None)
            if dtype is not None:
                to_tessera[dtype] = name
                to_torch[name] = dtype
        _torch_tables = (to_tessera, to_torch)
    return _torch_tables


def _unsupported(dtype: Any) -> TesseraError:
    return TesseraError(
        f"dtype {dtype} is not supported by tessera checkpoints; supported element types: "
        f"{', '.join(TESSERA_DTYPES)} (torch: float64/32/16, bfloat16, float8_e4m3fn, float8_e5m2, "
        "int64/32/16/8, uint8/16/32/64, bool)"
    )


def torch_dtype_to_tessera(dtype: Any) -> str:
    """The tessera name of a torch dtype (``torch.bfloat16`` -> ``"bf16"``).

    Raises TesseraError for dtypes the format cannot store (complex, quantized,
    float8 variants other than e4m3fn/e5m2, sub-byte integers).
    """
    to_tessera, _ = _tables()
    try:
        return to_tessera[dtype]
    except (KeyError, TypeError):
        raise _unsupported(dtype) from None


def tessera_dtype_to_torch(name: str) -> Any:
    """The torch dtype of a tessera element type name (``"bf16"`` -> ``torch.bfloat16``)."""
    _, to_torch = _tables()
    try:
        return to_torch[name]
    except KeyError:
        if name in TESSERA_TO_TORCH_NAME:
            import torch

            raise TesseraError(
                f"element type {name!r} needs a newer torch than {torch.__version__}"
            ) from None
        raise TesseraError(
            f"unknown tessera element type {name!r}; known: {', '.join(TESSERA_DTYPES)}"
        ) from None


def numpy_dtype_to_tessera(dtype: Any) -> str:
    """The tessera name of a numpy dtype (``np.float32`` -> ``"f32"``)."""
    import numpy as np

    try:
        np_dtype = np.dtype(dtype)
    except TypeError:
        raise _unsupported(dtype) from None
    for name, np_name in _TESSERA_TO_NUMPY_NAME.items():
        # Byte order matters: the format stores little-endian data.
        if np_dtype == np.dtype(np_name) and np_dtype.byteorder in ("=", "|", "<"):
            return name
    raise _unsupported(dtype)


def tessera_dtype_to_numpy(name: str) -> Any:
    """The numpy dtype of a tessera element type name; bf16 and float8 have none."""
    import numpy as np

    if name not in _TESSERA_TO_NUMPY_NAME:
        if name in TESSERA_TO_TORCH_NAME:
            raise TesseraError(f"element type {name!r} has no numpy dtype; load it as a torch tensor")
        raise TesseraError(f"unknown tessera element type {name!r}; known: {', '.join(TESSERA_DTYPES)}")
    return np.dtype(_TESSERA_TO_NUMPY_NAME[name])


def to_tessera_dtype(dtype: Any) -> str:
    """The tessera name of a torch dtype, a numpy dtype or an already tessera name."""
    if isinstance(dtype, str) and dtype in TESSERA_TO_TORCH_NAME:
        return dtype
    if type(dtype).__module__.startswith("torch"):
        return torch_dtype_to_tessera(dtype)
    return numpy_dtype_to_tessera(dtype)
