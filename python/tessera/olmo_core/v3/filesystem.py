"""OLMo-core 3.x's ``olmo_core.distributed.checkpoint.filesystem``: its DCP storage writer and
reader, for code that hands them to ``torch.distributed.checkpoint`` itself (OLMo-core's DDP
train module does).

They are torch's own ``FileSystemWriter`` / ``FileSystemReader`` under OLMo-core's names and
constructor arguments, for a local directory; the reader first opens the checkpoint through
tessera, so a ``.metadata`` that tessera's validation refuses (hostile pickle, chunks that do
not tile, data files too short) is refused before torch unpickles it. An object-store URL is
refused with a ``ValueError``: tessera's functions of :mod:`tessera.olmo_core.v3`
(``save_state_dict``, ``load_state_dict``, ...) read and write ``s3://``, ``gs://`` and
``az://`` themselves. ``_StorageInfo`` is here under OLMo-core's name so that the ``.metadata``
of a checkpoint OLMo-core wrote unpickles when this module stands in for OLMo-core's.

The reader unpickles ``.metadata`` itself, after tessera has validated it, with an unpickler
that builds only DCP's metadata classes, ``torch.Size``, torch dtypes, paths and ``_StorageInfo``
(OLMo-core's or torch's): nothing else is imported or called, with or without ai2-olmo-core
installed.
"""

from __future__ import annotations

import collections
import importlib
import os
import pathlib
import pickle
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ... import _native
from .._checkpointer import PathOrStr, _is_url, _normalize

__all__ = ["RemoteFileSystemWriter", "RemoteFileSystemReader"]


@dataclass
class _StorageInfo:
    """Where one item of a DCP data file is: OLMo-core's name for torch's ``_StorageInfo``."""

    relative_path: str
    offset: int
    length: int
    # torch's own _StorageInfo has it (its reader reads it); OLMo-core's files have none.
    transform_descriptors: Optional[Sequence[str]] = None


def _local_dir(path: PathOrStr, what: str) -> str:
    p = _normalize(path)
    if _is_url(p):
        raise ValueError(
            f"{what}({p!r}): tessera's DCP {what} classes write local directories; "
            "tessera.olmo_core.v3's save_state_dict / load_state_dict read and write object stores themselves"
        )
    return p


def _threads(thread_count: Optional[int]) -> int:
    if thread_count is not None and thread_count <= 0:
        raise ValueError("thread count must be at least 1")
    return thread_count or 1


class RemoteFileSystemWriter(FileSystemWriter):
    """OLMo-core's DCP storage writer (local directories): torch's ``FileSystemWriter`` with
    ``thread_count`` writer threads. ``process_count``, ``process_group`` and
    ``throttle_uploads`` are OLMo-core's options for uploads and are kept as attributes only."""

    def __init__(
        self,
        path: PathOrStr,
        thread_count: Optional[int] = None,
        process_count: Optional[int] = None,
        process_group: Any = None,
        throttle_uploads: bool = False,
    ) -> None:
        threads = _threads(thread_count)
        super().__init__(_local_dir(path, "RemoteFileSystemWriter"), thread_count=threads)
        self.thread_count = threads
        self.process_count = process_count
        self.process_group = process_group
        self.throttle_uploads = throttle_uploads


class RemoteFileSystemReader(FileSystemReader):
    """OLMo-core's DCP storage reader (local directories): torch's ``FileSystemReader``, whose
    :meth:`read_metadata` first has tessera open and validate the checkpoint. ``thread_count``,
    ``pre_download`` and ``work_dir`` (OLMo-core's download cache) are kept as attributes."""

    def __init__(
        self,
        path: PathOrStr,
        *,
        thread_count: Optional[int] = None,
        pre_download: bool = False,
        work_dir: Optional[PathOrStr] = None,
    ) -> None:
        super().__init__(_local_dir(path, "RemoteFileSystemReader"))
        self.thread_count = _threads(thread_count)
        self.pre_download = pre_download
        self.work_dir = work_dir

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # tessera's restricted unpickler and index validation see the bytes first.
        _native.load_tensors_metadata(str(self.path))
        metadata = read_dcp_metadata(os.path.join(str(self.path), ".metadata"))
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata


class _MetadataUnpickler(pickle.Unpickler):
    """Builds a DCP ``.metadata`` and nothing else (see the module's docstring)."""

    def __init__(self, file: Any, path: str) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("olmo_core.distributed.checkpoint.filesystem", "_StorageInfo"):
            return _StorageInfo
        found: Any = None
        if module.startswith("torch.distributed.checkpoint.") and not name.startswith("__"):
            found = getattr(importlib.import_module(module), name, None)
            found = found if isinstance(found, type) else None
        elif module == "torch" and name == "Size":
            found = torch.Size
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            found = getattr(torch, name)
        elif (module, name) == ("torch.serialization", "_get_layout"):
            found = getattr(torch.serialization, "_get_layout")
        elif (module, name) == ("collections", "OrderedDict"):
            found = collections.OrderedDict
        elif module == "pathlib" and name in ("PosixPath", "PurePosixPath", "Path"):
            found = getattr(pathlib, name)  # storage_meta.checkpoint_id, as torch's writer records it
        if found is None:
            raise pickle.UnpicklingError(f"{self.path}: {module}.{name} is not part of a DCP .metadata")
        return found


def read_dcp_metadata(path: str) -> Metadata:
    """The DCP ``Metadata`` pickled in ``path``, unpickled by :class:`_MetadataUnpickler`."""
    with open(path, "rb") as f:
        metadata = _MetadataUnpickler(f, path).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"{path}: holds a {type(metadata).__name__}, not a DCP Metadata")
    return metadata
