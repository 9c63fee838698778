"""Megatron's async DCP file writer (megatron-core's ``strategies.filesystem_async``), by name.

tessera writes checkpoints in its core: the native format and ``torch_dist`` alike (the async
save stages into native memory and a native thread writes and commits; see
``strategies.async_utils``). Nothing in tessera's save path uses this writer. It is kept for code
that drives ``torch.distributed.checkpoint`` itself with megatron's writer: it is torch's
``FileSystemWriter`` (one file per rank), and :meth:`FileSystemWriterAsync.write_preloaded_data`
writes one bucket of items the way megatron's worker does, reporting to ``results_queue``.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, List, Optional, Tuple, Union

from torch.distributed.checkpoint import FileSystemWriter

__all__ = ["FileSystemWriterAsync", "WriteBucket", "_results_queue", "_get_write_results_queue"]

# (file path, storage key, (byte items, tensor items)): the writes to one file.
WriteBucket = Tuple[Any, str, Tuple[list, list]]

#: Megatron keeps a multiprocessing results queue here; tessera's writer needs none, and
#: ``megatron.training.async_utils`` only shuts it down when it is set.
_results_queue = None


def _get_write_results_queue() -> Any:
    """The process-wide results queue (created on first use, as megatron does)."""
    global _results_queue
    if _results_queue is None:
        import multiprocessing as mp

        _results_queue = mp.Manager().Queue()
    return _results_queue


class FileSystemWriterAsync(FileSystemWriter):
    """torch's ``FileSystemWriter`` under megatron's name and signature (``separation_hint``
    and ``use_msc`` are kept as attributes)."""

    def __init__(
        self, path: Union[str, "os.PathLike[str]"], *args: Any, separation_hint: Optional[str] = None, use_msc: bool = False, **kwargs: Any
    ) -> None:
        self.checkpoint_dir = path
        self.use_msc = use_msc
        super().__init__(path, *args, **kwargs)
        self.can_run_decentralized_global_plan = True
        self.write_buckets: Optional[List[WriteBucket]] = None
        self.results_queue: Any = None
        self.separation_hint = separation_hint

    @staticmethod
    def write_preloaded_data(
        transform_list: List[Any],
        local_proc_idx: int,
        write_bucket: WriteBucket,
        results_queue: Any,
        count_queue: Any,
        use_fsync: bool,
        **kwargs: Any,
    ) -> None:
        """Writes one bucket (CPU tensors and bytes) to its file with torch's item writer and puts
        ``(local_proc_idx, results or the exception)`` on ``results_queue``."""
        from torch.distributed.checkpoint.filesystem import _write_item

        extra = {}
        if "serialization_format" in inspect.signature(_write_item).parameters:
            from torch.distributed.checkpoint.filesystem import SerializationFormat

            extra["serialization_format"] = SerializationFormat.TORCH_SAVE
        results: Any = []
        try:
            file_name, storage_key, (bytes_data, tensor_data) = write_bucket
            with open(file_name, "wb") as stream:
                for write_item, data in list(bytes_data) + list(tensor_data):
                    results.append(_write_item(*transform_list, stream, data, write_item, storage_key, **extra))
                if use_fsync:
                    os.fsync(stream.fileno())
        except Exception as e:  # reported to the caller through the queue, as megatron does
            results = e
        results_queue.put((local_proc_idx, results))
        count_queue.get()
        count_queue.task_done()
