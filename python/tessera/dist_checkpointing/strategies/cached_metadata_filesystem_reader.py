"""Megatron's DCP reader that caches ``.metadata`` (``strategies.cached_metadata_filesystem_reader``).

tessera's core reads ``torch_dist``/DCP checkpoints itself and parses ``.metadata`` once per
load; this is torch's ``FileSystemReader`` with megatron's cache, for code that reads with torch
DCP directly.
"""

from __future__ import annotations

import os
from typing import Any, Union

from torch.distributed.checkpoint import FileSystemReader

__all__ = ["CachedMetadataFileSystemReader"]


class CachedMetadataFileSystemReader(FileSystemReader):
    """A ``FileSystemReader`` that reads ``.metadata`` once and returns the cached copy after."""

    def __init__(self, path: Union[str, "os.PathLike[str]"]) -> None:
        super().__init__(path=path)
        self._cached_metadata: Any = None

    def read_metadata(self) -> Any:
        if self._cached_metadata is None:
            self._cached_metadata = super().read_metadata()
        return self._cached_metadata
