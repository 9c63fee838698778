"""The common base of sharded leaves, replica ids and non-persistent values.

Split out of ``mapping`` so that ``factories`` can build on it without importing
``ShardedTensor``; everything here is re-exported by ``mapping`` (Megatron's import path).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Dict, Tuple, Union

from .core import CheckpointingException

__all__ = [
    "ReplicaId",
    "StateDict",
    "ShardedStateDict",
    "ShardedBase",
    "LocalNonpersistentObject",
    "LocalNonpersitentObject",
    "is_main_replica",
]

ReplicaId = Union[int, Tuple[int, ...]]
# A state dict of any values; a sharded one holds ShardedBase leaves where data is sharded.
StateDict = Dict[str, Any]
ShardedStateDict = Dict[str, Any]


class ShardedBase(ABC):
    """Common base of everything that maps local data onto a global checkpoint entry."""

    key: str
    data: object
    replica_id: ReplicaId

    @abstractmethod
    def validate_metadata_integrity(self) -> None:
        """Raises CheckpointingException if the metadata is inconsistent."""

    @abstractmethod
    def without_data(self) -> "ShardedBase":
        """A copy carrying only metadata (``data=None``)."""


def _int_tuple(values: Any, what: str, key: str) -> Tuple[int, ...]:
    try:
        return tuple(int(v) for v in values)
    except (TypeError, ValueError):
        raise CheckpointingException(f"{key!r}: {what} must be a sequence of integers, got {values!r}") from None


class LocalNonpersistentObject:
    """A value that is not saved; on load, the local value is put back in the state dict."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def unwrap(self) -> Any:
        return self.obj

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}({self.obj!r})"


# Megatron-Core's spelling, kept so that code importing it keeps working.
LocalNonpersitentObject = LocalNonpersistentObject


def is_main_replica(replica_id: ReplicaId) -> bool:
    """True for the replica that is saved: ``0`` or a tuple of zeros."""
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)
