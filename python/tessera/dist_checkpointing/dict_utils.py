"""Utilities for operating on nested dicts and lists (Megatron-Core semantics).

Every function traverses dicts and lists; anything else (tuples, tensors, sharded tensors, ...)
is an atomic leaf.

torch is an optional extra of the package, so it is imported where it is used, not with this
module.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from typing import Any, Callable, Dict, Iterable, Iterator, List, Literal, Tuple, Union, overload

import numpy as np

from .core import CheckpointingValueError

__all__ = [
    "extract_matching_values",
    "diff",
    "inspect_types",
    "nested_values",
    "nested_items_iter",
    "dict_map",
    "dict_map_with_key",
    "dict_list_map_inplace",
    "dict_list_map_outplace",
    "merge",
    "map_reduce",
]

Nested = Union[dict, list]


def _is_container(x: Any) -> bool:
    return isinstance(x, (dict, list))


# A dict (or a list with ``return_lists_as_dicts``) splits into two dicts; a list into two lists.
@overload
def extract_matching_values(
    x: dict, predicate: Callable[[Any], bool], return_lists_as_dicts: bool = ...
) -> Tuple[dict, dict]: ...
@overload
def extract_matching_values(
    x: list, predicate: Callable[[Any], bool], return_lists_as_dicts: Literal[True]
) -> Tuple[dict, dict]: ...
@overload
def extract_matching_values(
    x: list, predicate: Callable[[Any], bool], return_lists_as_dicts: Literal[False] = ...
) -> Tuple[list, list]: ...
@overload
def extract_matching_values(
    x: Nested, predicate: Callable[[Any], bool], return_lists_as_dicts: bool = ...
) -> Tuple[Nested, Nested]: ...


def extract_matching_values(
    x: Nested, predicate: Callable[[Any], bool], return_lists_as_dicts: bool = False
) -> Tuple[Nested, Nested]:
    """Splits ``x`` into (matching, non-matching) leaves, both keeping the hierarchy.

    A container appears on a side only if it has leaves there; empty containers stay on the
    non-matching side so that they survive a split and merge. With ``return_lists_as_dicts``
    lists become dicts keyed by the original indices, so that a partial list can be merged back
    into the original positions.
    """
    if isinstance(x, dict):
        matching: Nested = {}
        nonmatching: Nested = {}
        items: Iterable[Tuple[Any, Any]] = x.items()
    elif isinstance(x, list):
        matching = {} if return_lists_as_dicts else []
        nonmatching = {} if return_lists_as_dicts else []
        items = enumerate(x)
    else:
        raise CheckpointingValueError(f"unexpected top-level object type {type(x).__name__}: expected a dict or list")

    def put(target: Nested, key: Any, value: Any) -> None:
        if isinstance(target, dict):
            target[key] = value
        else:
            target.append(value)

    for key, value in items:
        if _is_container(value) and value:
            sub_matching, sub_nonmatching = extract_matching_values(value, predicate, return_lists_as_dicts)
            if sub_matching:
                put(matching, key, sub_matching)
            if sub_nonmatching:
                put(nonmatching, key, sub_nonmatching)
        elif _is_container(value):
            put(nonmatching, key, value)
        elif predicate(value):
            put(matching, key, value)
        else:
            put(nonmatching, key, value)
    return matching, nonmatching


def _values_differ(x1: Any, x2: Any) -> bool:
    """Leaf comparison: tensors and arrays by value, anything else with ``!=``."""
    torch_tensor = _torch_tensor_type()
    if torch_tensor is not None and isinstance(x1, torch_tensor) and isinstance(x2, torch_tensor):
        import torch

        return x1.dtype != x2.dtype or x1.shape != x2.shape or not torch.equal(x1.cpu(), x2.cpu())
    if type(x1).__module__ == "numpy" and type(x2).__module__ == "numpy":
        return not np.array_equal(x1, x2)
    try:
        return bool(x1 != x2)
    except (RuntimeError, ValueError, TypeError):
        # e.g. a tensor against a list: no truth value, and certainly not equal.
        return True


def _torch_tensor_type() -> Any:
    torch = sys.modules.get("torch")  # a tensor can only exist if torch was imported
    return getattr(torch, "Tensor", None)


def diff(x1: Any, x2: Any, prefix: Tuple = ()) -> Tuple[list, list, list]:
    """Recursive diff of two nested dicts/lists.

    Returns (only_left, only_right, mismatch): key paths present only in ``x1``, key paths
    present only in ``x2``, and ``(path, type(left), type(right))`` for values present in both
    but different (tensors compared element-wise, with dtype and shape).
    """
    only_left: List[tuple] = []
    only_right: List[tuple] = []
    mismatch: List[tuple] = []
    if isinstance(x1, dict) and isinstance(x2, dict):
        only_left = [prefix + (k,) for k in x1 if k not in x2]
        only_right = [prefix + (k,) for k in x2 if k not in x1]
        common = [(k, x1[k], x2[k]) for k in x1 if k in x2]
    elif isinstance(x1, list) and isinstance(x2, list):
        only_left = [prefix + (i,) for i in range(len(x2), len(x1))]
        only_right = [prefix + (i,) for i in range(len(x1), len(x2))]
        common = [(i, v1, v2) for i, (v1, v2) in enumerate(zip(x1, x2))]
    else:
        if _values_differ(x1, x2):
            mismatch.append((prefix, type(x1), type(x2)))
        return only_left, only_right, mismatch
    for key, v1, v2 in common:
        sub_left, sub_right, sub_mismatch = diff(v1, v2, prefix + (key,))
        only_left.extend(sub_left)
        only_right.extend(sub_right)
        mismatch.extend(sub_mismatch)
    return only_left, only_right, mismatch


def inspect_types(x: Any, prefix: Tuple = (), indent: int = 4) -> None:
    """Prints the (nested) structure of ``x`` with the type of each leaf."""
    pad = " " * indent * len(prefix)
    if isinstance(x, dict):
        print()
        for k, v in x.items():
            print(f"{pad}> {k}: ", end="")
            inspect_types(v, prefix + (k,), indent)
    elif isinstance(x, list):
        print()
        for i, v in enumerate(x):
            print(f"{pad}- {i}: ", end="")
            inspect_types(v, prefix + (i,), indent)
    else:
        torch_tensor = _torch_tensor_type()
        if torch_tensor is not None and isinstance(x, torch_tensor):
            print(f"Tensor of shape {tuple(x.shape)}")
            return
        try:
            text = str(x)
        except Exception:  # a leaf whose __str__ fails must not break inspection
            text = "<no string repr>"
        if len(text) > 30:
            text = text[:30] + "... (truncated)"
        print(f"[{type(x)}]: {text}")


def nested_values(x: Nested) -> Iterator[Any]:
    """Every leaf value of a nested dict/list, depth first."""
    for v in x.values() if isinstance(x, dict) else x:
        if _is_container(v):
            yield from nested_values(v)
        else:
            yield v


def nested_items_iter(x: Nested) -> Iterator[Tuple[Nested, Any, Any]]:
    """Every leaf as ``(container, key, value)``, so that callers can replace it in place."""
    for k, v in x.items() if isinstance(x, dict) else enumerate(x):
        if _is_container(v):
            yield from nested_items_iter(v)
        else:
            yield x, k, v


def dict_map(f: Callable[[Any], Any], d: Nested) -> None:
    """Replaces every leaf ``v`` of ``d`` by ``f(v)``, in place."""
    for container, k, v in nested_items_iter(d):
        container[k] = f(v)


def dict_map_with_key(f: Callable[[Any, Any], Any], d: dict) -> None:
    """Replaces every leaf of nested dicts by ``f(key, value)``, in place (lists are leaves)."""
    for k, v in d.items():
        if isinstance(v, dict):
            dict_map_with_key(f, v)
        else:
            d[k] = f(k, v)


def dict_list_map_inplace(f: Callable[[Any], Any], x: Any) -> Any:
    """Maps the leaves of nested dicts and lists in place; returns ``x`` (or ``f(x)`` for a leaf)."""
    if isinstance(x, dict):
        for k, v in x.items():
            x[k] = dict_list_map_inplace(f, v)
    elif isinstance(x, list):
        x[:] = [dict_list_map_inplace(f, v) for v in x]
    else:
        return f(x)
    return x


def dict_list_map_outplace(f: Callable[[Any], Any], x: Any) -> Any:
    """Maps the leaves of nested dicts and lists into a new structure."""
    if isinstance(x, dict):
        return {k: dict_list_map_outplace(f, v) for k, v in x.items()}
    if isinstance(x, list):
        return [dict_list_map_outplace(f, v) for v in x]
    return f(x)


def _describe(x: Any) -> str:
    """A short description of a leaf for error messages (a tensor's repr can be huge)."""
    text = repr(x)
    return text if len(text) <= 60 else f"<{type(x).__name__}>"


def merge(x1: Nested, x2: Nested, key: Tuple = ()) -> Nested:
    """Merges ``x2`` into ``x1`` recursively (in place) and returns ``x1``.

    Dicts are united; lists of equal length are merged element-wise; a dict with integer keys
    (see ``extract_matching_values(..., return_lists_as_dicts=True)``) is merged into a list at
    those indices. Two leaves at the same place are an error.
    """
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            x1[k] = merge(x1[k], v2, key + (k,)) if k in x1 else v2
    elif isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise CheckpointingValueError(
                f"cannot merge two lists with different lengths ({len(x1)} and {len(x2)}, at key {key})"
            )
        for i, v2 in enumerate(x2):
            x1[i] = merge(x1[i], v2, key + (i,))
    elif isinstance(x1, list) and isinstance(x2, dict):
        for k, v2 in x2.items():
            if not isinstance(k, int):
                raise CheckpointingValueError(f"non-integer key {k!r} in a list-dict merge (at key {key})")
            if not 0 <= k < len(x1):
                raise CheckpointingValueError(f"index {k} out of bounds for a list of length {len(x1)} (at key {key})")
            x1[k] = merge(x1[k], v2, key + (k,))
    else:
        raise CheckpointingValueError(
            f"duplicate non-dict and non-list values encountered: {_describe(x1)} and {_describe(x2)} (at key {key})"
        )
    return x1


def map_reduce(
    xs: Iterable,
    key_fn: Callable[[Any], Any] = lambda x: x,
    value_fn: Callable[[Any], Any] = lambda x: x,
    reduce_fn: Callable[[List[Any]], Any] = lambda x: x,
) -> Dict[Any, Any]:
    """Groups ``value_fn(x)`` by ``key_fn(x)`` and reduces each group with ``reduce_fn``
    (the interface of ``more_itertools.map_reduce``)."""
    groups: Dict[Any, List[Any]] = defaultdict(list)
    for x in xs:
        groups[key_fn(x)].append(value_fn(x))
    return {k: reduce_fn(v) for k, v in groups.items()}
