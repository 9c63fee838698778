"""Plain values, their ``torch.save`` fallback, and the tags of object payloads.

A plain value (None/bool/int/float/str/bytes, lists and str-keyed dicts of them) is stored as
itself, in the core's value encoding, and every tool reads it. Anything else is stored as its
``torch.save`` bytes under ``TORCH_SAVE_KEY`` and comes back through
``torch.load(weights_only=True)`` with ``argparse.Namespace`` allowed: loading never runs
arbitrary code. Object payloads (Megatron's ``ShardedObject``) start with a tag saying which of
the two they hold. The tags and the key are the Rust core's (``tessera._native``), which reads
them when it converts a checkpoint.

torch is imported only where a value needs it: the Megatron mirror works on numpy alone.
"""

from __future__ import annotations

import argparse
import io
from typing import Any, Dict

from .. import _native
from ..errors import TesseraError
from .paths import leaves

__all__ = [
    "TORCH_SAVE_KEY",
    "is_plain",
    "to_plain",
    "from_plain",
    "torch_save_bytes",
    "torch_load_bytes",
    "encode_object",
    "decode_object",
    "like_request",
    "is_stateful",
    "match_request",
]

TORCH_SAVE_KEY: str = _native.TORCH_SAVE_KEY
_PLAIN_OBJECT: bytes = _native.OBJECT_TAG_VALUE
_TORCH_OBJECT: bytes = _native.OBJECT_TAG_TORCH
# A foreign object stored as torch.save([obj]) (Megatron torch_dist ShardedObjects): the
# payload is those bytes, the object is the list's only element.
_TORCH_LIST_OBJECT: bytes = _native.OBJECT_TAG_TORCH_LIST


def is_plain(value: Any, tuples: bool = False) -> bool:
    """Exact types only: a subclass (OrderedDict, IntEnum, numpy scalars) would come back as
    its base type, so it takes the torch.save path and keeps its type. With ``tuples``, a
    tuple counts as plain and is stored as a list (``tessera.torch``, where a load gives it
    back as a tuple where the request holds one: :func:`like_request`); Megatron's common state
    keeps exact types, tuples included."""
    kind = type(value)
    if value is None or kind in (bool, str, bytes, float):
        return True
    if kind is int:
        return -(2**63) <= value < 2**63
    if kind is list or (tuples and kind is tuple):
        return all(is_plain(v, tuples) for v in value)
    if kind is dict:
        return all(type(k) is str and is_plain(v, tuples) for k, v in value.items())
    return False


def torch_save_bytes(value: Any) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def torch_load_bytes(data: bytes) -> Any:
    import torch

    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2] if p.isdigit())
    if version < (2, 6):
        # Checkpoint bytes may come from anyone: before 2.6, weights_only=True could be made to
        # run code (CVE-2025-32434).
        raise RuntimeError(
            f"loading Python objects from a checkpoint needs torch >= 2.6 (this is {torch.__version__}): "
            "torch.load(weights_only=True) of earlier versions is not safe on untrusted bytes"
        )
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


def to_plain(value: Any, tuples: bool = False) -> Any:
    """A plain value, or the torch.save wrapper for anything else (``tuples``: see
    :func:`is_plain`)."""
    if is_plain(value, tuples) and not (isinstance(value, dict) and set(value) == {TORCH_SAVE_KEY}):
        return value
    return {TORCH_SAVE_KEY: torch_save_bytes(value)}


def from_plain(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {TORCH_SAVE_KEY} and isinstance(value[TORCH_SAVE_KEY], bytes):
        return torch_load_bytes(value[TORCH_SAVE_KEY])
    return value


def encode_object(value: Any) -> bytes:
    if is_plain(value):
        return _PLAIN_OBJECT + _native.encode_value(value)
    return _TORCH_OBJECT + torch_save_bytes(value)


def decode_object(data: bytes) -> Any:
    head, body = data[:4], data[4:]
    if head == _PLAIN_OBJECT:
        return _native.decode_value(body)
    if head == _TORCH_OBJECT:
        return torch_load_bytes(body)
    if head == _TORCH_LIST_OBJECT:
        wrapped = torch_load_bytes(body)
        if not isinstance(wrapped, (list, tuple)) or len(wrapped) != 1:
            raise TesseraError(f"sharded object payload tagged {head!r} is not a one-element list")
        return wrapped[0]
    raise TesseraError(f"sharded object payload has an unknown encoding tag {head!r}")


def like_request(saved: Any, requested: Any) -> Any:
    """``saved`` with the tuples the request held where the checkpoint stores lists (plain
    values keep no tuple type), e.g. Adam's ``betas``."""
    if isinstance(requested, (tuple, list)) and isinstance(saved, list) and len(saved) == len(requested):
        items = [like_request(s, r) for s, r in zip(saved, requested)]
        return tuple(items) if isinstance(requested, tuple) else items
    if isinstance(requested, dict) and isinstance(saved, dict):
        return {k: like_request(v, requested.get(k)) for k, v in saved.items()}
    return saved


def is_stateful(value: Any) -> bool:
    """torch DCP's ``Stateful``: a value with ``state_dict()`` and ``load_state_dict()``, saved
    as its ``state_dict()`` and handed what was loaded through ``load_state_dict()``."""
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def match_request(state: Dict[str, Any], request: Dict[str, Any]) -> None:
    """Gives the loaded ``state`` the request's types where the checkpoint cannot keep them: a
    tuple leaf of ``request`` stored as a list becomes a tuple again (:func:`like_request`),
    and a ``Stateful`` leaf gets its loaded state through ``load_state_dict`` and takes its
    place in ``state``."""

    def holds(node: Any, kind: str, seg: Any) -> bool:
        return isinstance(node, list) and kind == "i" and seg < len(node) or isinstance(node, dict) and seg in node

    for path, leaf in leaves(request):
        if not path or not (isinstance(leaf, tuple) or is_stateful(leaf)):
            continue
        node: Any = state
        for kind, seg in path[:-1]:
            if not holds(node, kind, seg):
                break
            node = node[seg]
        else:
            kind, seg = path[-1]
            if not holds(node, kind, seg):
                continue
            if isinstance(leaf, tuple):
                node[seg] = like_request(node[seg], leaf)
            else:
                leaf.load_state_dict(node[seg])
                node[seg] = leaf
