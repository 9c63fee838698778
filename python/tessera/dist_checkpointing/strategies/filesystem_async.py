"""Megatron's async DCP file writer (megatron-core's ``strategies.filesystem_async``).

A ``torch_dist`` save runs as megatron's does, with tessera's core doing the work: the core
plans it (``tessera._native.plan_torch_dist``), :meth:`FileSystemWriterAsync.write_preloaded_data`
writes each of a rank's data files (a bucket: ``tessera._native.TorchDistFile``) on a worker
of its own, :meth:`FileSystemWriterAsync.retrieve_write_results` collects the workers'
results, and the core commits (:class:`TorchDistWrites`). Workers are threads, not the forked
processes megatron starts: the core writes without holding the GIL, and a thread needs no copy
of the state. The writer also keeps torch's ``FileSystemWriter`` behaviour for code that drives
``torch.distributed.checkpoint`` itself with megatron's writer (a bucket of torch write items
is written with torch's item writer).

torch is optional for the package, which imports this module for every save: torch's names are
imported where a write uses them, and the writer's base class only when torch is there.
"""

from __future__ import annotations

import inspect
import multiprocessing as mp
import os
import queue
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from ... import _native
from ...errors import TesseraError

try:
    from torch.distributed.checkpoint import FileSystemWriter
except ImportError:  # without torch nothing writes torch_dist; the class is still defined
    FileSystemWriter = object  # type: ignore[misc,assignment]

__all__ = ["FileSystemWriterAsync", "TorchDistWrites", "WriteBucket", "_results_queue", "_get_write_results_queue"]

# (file path, storage key, (byte items, tensor items)): the writes to one file.
WriteBucket = Tuple[Any, str, Tuple[list, list]]

#: Megatron keeps a multiprocessing results queue here; tessera's writer needs none, and
#: ``megatron.training.async_utils`` only shuts it down when it is set.
_results_queue = None


def _get_write_results_queue() -> Any:
    """The process-wide results queue (created on first use, as megatron does)."""
    global _results_queue
    if _results_queue is None:
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
        """Writes one bucket and puts ``(local_proc_idx, results or the exception)`` on
        ``results_queue``, then marks the worker done on ``count_queue``. A bucket is one data
        file of a save the core planned (``tessera._native.TorchDistFile``: the core writes it;
        the result is its size) or, as megatron makes them, ``(file, storage key, (byte items,
        tensor items))`` of CPU tensors and bytes written with torch's item writer."""
        results: Any = []
        try:
            if isinstance(write_bucket, _native.TorchDistFile):
                results = [write_bucket.write()]
            else:
                results = FileSystemWriterAsync._write_torch_items(transform_list, write_bucket, use_fsync)
        except Exception as e:  # reported to the caller through the queue, as megatron does
            results = e
        results_queue.put((local_proc_idx, results))
        count_queue.get()
        count_queue.task_done()

    @staticmethod
    def _write_torch_items(transform_list: List[Any], write_bucket: WriteBucket, use_fsync: bool) -> list:
        """A megatron bucket of torch write items, written with torch's item writer."""
        from torch.distributed.checkpoint.filesystem import _write_item as _torch_write_item

        # torch's private item writer: its parameters differ across torch versions (the
        # transforms, serialization_format), so it is called with what this version takes.
        _write_item: Callable[..., Any] = _torch_write_item
        extra: Dict[str, Any] = {}
        if "serialization_format" in inspect.signature(_write_item).parameters:
            from torch.distributed.checkpoint.filesystem import SerializationFormat

            extra["serialization_format"] = SerializationFormat.TORCH_SAVE
        results = []
        file_name, storage_key, (bytes_data, tensor_data) = write_bucket
        with open(file_name, "wb") as stream:
            for write_item, data in list(bytes_data) + list(tensor_data):
                results.append(_write_item(*transform_list, stream, data, write_item, storage_key, **extra))
            if use_fsync:
                os.fsync(stream.fileno())
        return results

    @staticmethod
    def write_preloaded_data_multiproc(
        transform_list: List[Any],
        use_msc: bool,
        rank: int,
        write_buckets: List[Any],
        global_results_queue: Any,
    ) -> None:
        """Writes every bucket, each by :meth:`write_preloaded_data` (looked up when called, so a
        replaced one is the one run) on a worker thread of its own, and puts on
        ``global_results_queue`` either ``{bucket index: results}`` or the first worker's
        exception, as megatron's does."""
        local_results: "queue.Queue[Tuple[int, Any]]" = queue.Queue()
        count_queue: "queue.Queue[int]" = queue.Queue()
        workers = []
        for i, bucket in enumerate(write_buckets):
            count_queue.put(i)
            kwargs = dict(
                local_proc_idx=i, write_bucket=bucket, results_queue=local_results, count_queue=count_queue, use_fsync=True
            )
            workers.append(
                threading.Thread(
                    target=FileSystemWriterAsync.write_preloaded_data,
                    args=(transform_list,),
                    kwargs=kwargs,
                    name=f"tessera-write-{rank}-{i}",
                    daemon=True,
                )
            )
        for w in workers:
            w.start()
        count_queue.join()
        collected: Dict[int, Any] = {}
        results_or_exc: Union[Dict[int, Any], Exception] = collected
        for _ in write_buckets:
            try:
                idx, result = local_results.get_nowait()
            except queue.Empty:
                results_or_exc = RuntimeError(
                    f"Unexpected empty `local_results_queue` (got only {len(collected)}/{len(write_buckets)} items)"
                )
                break
            if isinstance(result, Exception):
                results_or_exc = result
                break
            collected[idx] = result
        for w in workers:
            w.join()
        global_results_queue.put(results_or_exc)

    def retrieve_write_results(self) -> Any:
        """The workers' results as one list, or a wrapped exception (``(exception, stack)``,
        torch's ``WRAPPED_EXCEPTION``) when a worker failed or some result is missing."""
        from torch.distributed.checkpoint.api import _wrap_exception

        assert self.write_buckets is not None
        if self.results_queue is None:
            results: Any = {}
        else:
            try:
                results = self.results_queue.get_nowait()
            except queue.Empty:
                return _wrap_exception(RuntimeError("results_queue should not be empty"))
        if isinstance(results, Exception):
            try:
                raise RuntimeError(f"Worker failure: {results}") from results
            except RuntimeError as e:
                return _wrap_exception(e)
        if len(results) != len(self.write_buckets):
            return _wrap_exception(
                RuntimeError(
                    f"Incomplete worker results (expected {len(self.write_buckets)}, got {len(results)}. "
                    "This probably indicates a worker failure."
                )
            )
        return [r for i in sorted(results) for r in results[i]]


class TorchDistWrites:
    """A ``torch_dist`` save the core planned (``save``, a ``tessera._native.TorchDistSave``),
    written through :class:`FileSystemWriterAsync` (at once, or on a background thread when
    ``background``) and committed by :meth:`finalize`. The handle of an ``AsyncRequest``.

    :meth:`finalize` is collective. A failure anywhere (a worker's error, or the commit's)
    commits nothing, removes the save's files and raises torch's ``CheckpointException``, as
    megatron's finalize does: with the failure on the coordinator (rank 0) and empty elsewhere;
    the core's error, which names the failing rank and file, is its ``__cause__`` everywhere."""

    def __init__(self, save: Any, location: str, comm: Any, rank: int, background: bool) -> None:
        self._save = save
        self._comm = comm
        self._rank = rank
        self.writer = FileSystemWriterAsync(location)
        self.writer.write_buckets = save.files()
        self.writer.results_queue = queue.Queue()
        args: Tuple[List[Any], bool, int, Any, Any] = (
            [], False, rank, self.writer.write_buckets, self.writer.results_queue
        )
        self._thread: Optional[threading.Thread] = None
        if background:
            self._thread = threading.Thread(
                target=FileSystemWriterAsync.write_preloaded_data_multiproc, args=args, name="tessera-torch-dist", daemon=True
            )
            self._thread.start()
        else:
            FileSystemWriterAsync.write_preloaded_data_multiproc(*args)

    #: finalize commits collectively: AsyncCallsQueue finalizes it on every rank at once.
    collective_finalize = True

    def is_done(self) -> bool:
        """True once this rank's files are written or failed (local, no communication)."""
        return self._thread is None or not self._thread.is_alive()

    def finalize(self) -> dict:
        """Waits for this rank's files, then commits (collective); returns the save report."""
        from torch.distributed.checkpoint import CheckpointException
        from torch.distributed.checkpoint.api import _wrap_exception

        if self._thread is not None:
            self._thread.join()
        results = self.writer.retrieve_write_results()
        failure, written = None, 0
        if isinstance(results, tuple):  # a wrapped exception
            failure = str(results[0])
        else:
            written = sum(r for r in results if isinstance(r, int))
        try:
            return self._save.commit(written, self._comm, failure)
        except TesseraError as e:
            failures = {getattr(e, "rank", self._rank): _wrap_exception(e)} if self._rank == 0 else {}
            raise CheckpointException("write", failures) from e

