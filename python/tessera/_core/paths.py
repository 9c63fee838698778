"""Walking nested state dicts, and a path's encoding for the core.

A path segment is ``("k", key)`` for a dict key or ``("i", index)`` for a list position: dict
keys may be ints (an optimizer's ``state``), so the kind travels with the segment. The core's
paths are strings and list indices; an integer dict key crosses as ``INT_KEY_PREFIX + str(key)``
(FORMAT.md, "What the Python package adds").
"""

from __future__ import annotations

from typing import Any, Iterable, List, Tuple, Union

from .. import _native

__all__ = ["Seg", "leaves", "to_native_path", "from_native_path", "set_path", "dotted"]

Seg = Tuple[str, Any]
_INT_KEY: str = _native.INT_KEY_PREFIX


def leaves(tree: Any, path: Tuple[Seg, ...] = ()) -> Iterable[Tuple[Tuple[Seg, ...], Any]]:
    """(path, leaf) for every leaf; empty dicts and lists are leaves so that they survive."""
    if isinstance(tree, dict) and tree:
        for k, v in tree.items():
            yield from leaves(v, path + (("k", k),))
    elif isinstance(tree, list) and tree:
        for i, v in enumerate(tree):
            yield from leaves(v, path + (("i", i),))
    else:
        yield path, tree


def dotted(path: Tuple[Seg, ...]) -> str:
    """The dotted key of a path (``model.layers.0.weight``), as torch names state dict keys."""
    return ".".join(str(seg) for _, seg in path)


def to_native_path(path: Tuple[Seg, ...]) -> List[Union[str, int]]:
    out: List[Union[str, int]] = []
    for kind, k in path:
        if kind == "i":
            out.append(k)
        elif isinstance(k, str):
            out.append(k)
        elif isinstance(k, int) and not isinstance(k, bool):
            out.append(f"{_INT_KEY}{k}")
        else:
            raise TypeError(f"state dict key {k!r} ({type(k).__name__}) is neither str nor int")
    return out


def from_native_path(path: Iterable[Union[str, int]]) -> Tuple[Seg, ...]:
    out: List[Seg] = []
    for seg in path:
        if isinstance(seg, int):
            out.append(("i", seg))
        elif seg.startswith(_INT_KEY):
            out.append(("k", int(seg[len(_INT_KEY) :])))
        else:
            out.append(("k", seg))
    return tuple(out)


def set_path(root: Any, path: Tuple[Seg, ...], value: Any) -> None:
    """Puts ``value`` at ``path`` under ``root``, creating the dicts and lists on the way."""
    node: Any = root
    for (kind, seg), (next_kind, _) in zip(path[:-1], path[1:]):
        child_kind = list if next_kind == "i" else dict
        if kind == "i":
            while len(node) <= seg:
                node.append(None)
            if not isinstance(node[seg], child_kind):
                node[seg] = child_kind()
            node = node[seg]
        else:
            if not isinstance(node.get(seg), child_kind):
                node[seg] = child_kind()
            node = node[seg]
    kind, last = path[-1]
    if kind == "i":
        while len(node) <= last:
            node.append(None)
    node[last] = value
