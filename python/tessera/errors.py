"""tessera's exceptions: one class per error of the library, all under :class:`TesseraError`.

Each class also subclasses the builtin that fits, so ``except FileNotFoundError`` catches a
missing checkpoint. The attributes of each error (``key``, ``path``, ``reason``, ``found``,
``supported``, ``rank``, ...) are set on the exception instance where the error has them.
"""

from ._native import (
    AccessDeniedError,
    AlreadyExistsError,
    CommError,
    CommitUnknownError,
    CorruptError,
    IncompatibleVersionError,
    InvalidArgumentError,
    InvalidShardingError,
    KeyMismatchError,
    MismatchError,
    NotCommittedError,
    NotCoveredError,
    NotFoundError,
    PeerFailedError,
    StorageIOError,
    TesseraError,
    UnknownStrategyError,
)

__all__ = [
    "TesseraError",
    "NotFoundError",
    "NotCommittedError",
    "AlreadyExistsError",
    "CorruptError",
    "IncompatibleVersionError",
    "InvalidShardingError",
    "NotCoveredError",
    "MismatchError",
    "KeyMismatchError",
    "UnknownStrategyError",
    "InvalidArgumentError",
    "PeerFailedError",
    "CommError",
    "StorageIOError",
    "AccessDeniedError",
    "CommitUnknownError",
]
