"""Type stubs of ``tessera._native``, the Rust extension (crates/tessera-py).

A thin layer over the Rust library: every function releases the GIL while it works (it
re-acquires it only to call the Python communicator). Locations are strings (a local path,
``file://...``, ``s3://``, ``gs://``, ``az://`` URLs, or ``mem://name``: a process-wide
in-memory store, for tests), or a :class:`Location` carrying storage options.

Tensors and objects cross as typed values (:class:`SaveTensor`, :class:`LoadTensor`,
:class:`SaveObject`, :class:`LoadObject`). Tensor memory crosses as ``(data_ptr, nbytes)``: the address of C-contiguous CPU memory
(``tensor.data_ptr()``, ``array.ctypes.data``) that the caller keeps alive, and does not touch
from other threads, for the duration of the call. ``data_ptr == 0`` with ``nbytes > 0`` raises
:class:`InvalidArgumentError`; on load, overlapping buffers raise it too.

dtype names: ``"f64" "f32" "f16" "bf16" "f8_e4m3fn" "f8_e5m2" "i64" "i32" "i16" "i8" "u8"
"u16" "u32" "u64" "bool"`` (safetensors names such as ``"BF16"`` are accepted as well).

Plain values (common state, content metadata) are exactly ``None``, ``bool``, ``int``
(64-bit), ``float``, ``str``, ``bytes``, ``list`` and ``dict`` with ``str`` keys, nested;
anything else (tuples, subclasses) raises ``TypeError``. Paths are lists of ``str`` (dict keys)
and ``int`` (list indices). Values at list indices are stored in lists; a list index skipped
by the paths given to :func:`save` is stored as ``None``.
"""

from typing import Any, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple, Union, final

PlainValue = Union[None, bool, int, float, str, bytes, List["PlainValue"], Dict[str, "PlainValue"]]
Path = List[Union[str, int]]
Shape = Sequence[int]
ReplicaId = Union[int, Sequence[int]]

FlatRange = Optional[Tuple[int, int]]

@final
class Location:
    """A checkpoint location and the storage options it is opened with: ``object_store``
    configuration keys applied over the environment and credential files (local paths ignore
    them)."""

    def __new__(cls, url: str, storage_options: Optional[Mapping[str, Any]] = None) -> "Location": ...
    def __getnewargs__(self) -> Tuple[str, Dict[str, str]]: ...
    @property
    def url(self) -> str: ...
    @property
    def storage_options(self) -> Dict[str, str]: ...
    @property
    def local_dir(self) -> Optional[str]:
        """The local directory (a plain path or ``file://``), None for other locations."""

LocationLike = Union[str, Location]

@final
class SaveTensor:
    """A tensor shard to save: ``global_shape[i]`` elements on global axis ``i``, of which this
    shard holds the box at ``global_offset`` of shape ``[1] * prepend_axis_num + local_shape``
    (``flattened_range``: only ``[start, end)`` of the box's row-major flattening), and
    ``(data_ptr, nbytes)``, its memory (``0, 0``: none, to validate the layout only). Only the
    main replica (``replica_id`` all zeros) is written; ``axis_fragmentations`` (None: uneven
    sharding) says into how many equal chunks each global axis is cut.

    Made with keyword arguments; every field is converted when it is made: a field of the wrong
    type raises ``TypeError``, a negative size ``InvalidArgumentError``, both naming the key.
    """

    def __new__(
        cls,
        *,
        key: str,
        dtype: str,
        local_shape: Shape,
        global_shape: Shape,
        global_offset: Shape,
        prepend_axis_num: int = 0,
        replica_id: ReplicaId = 0,
        flattened_range: FlatRange = None,
        axis_fragmentations: Optional[Shape] = None,
        data_ptr: int = 0,
        nbytes: int = 0,
    ) -> "SaveTensor": ...
    def check(self, in_bounds: bool = True) -> None:
        """The core's checks of this tensor alone (axes, the box inside the global shape when
        ``in_bounds``, as a save requires, fragmentations, the flattened range): raises
        :class:`InvalidShardingError` naming the key."""
    @property
    def key(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def local_shape(self) -> Tuple[int, ...]: ...
    @property
    def global_shape(self) -> Tuple[int, ...]: ...
    @property
    def global_offset(self) -> Tuple[int, ...]: ...
    @property
    def prepend_axis_num(self) -> int: ...
    @property
    def replica_id(self) -> Tuple[int, ...]: ...
    @property
    def flattened_range(self) -> FlatRange: ...
    @property
    def axis_fragmentations(self) -> Optional[Tuple[int, ...]]: ...
    @property
    def data_ptr(self) -> int: ...
    @property
    def nbytes(self) -> int: ...

@final
class LoadTensor:
    """A tensor shard to load into ``(data_ptr, nbytes)``, fields as :class:`SaveTensor`'s;
    with ``allow_shape_mismatch`` the stored global shape may differ (the overlap is read, the
    rest zeroed). Made with keyword arguments, converted as :class:`SaveTensor`."""

    def __new__(
        cls,
        *,
        key: str,
        dtype: str,
        local_shape: Shape,
        global_shape: Shape,
        global_offset: Shape,
        data_ptr: int,
        nbytes: int,
        prepend_axis_num: int = 0,
        flattened_range: FlatRange = None,
        allow_shape_mismatch: bool = False,
    ) -> "LoadTensor": ...
    @property
    def key(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def local_shape(self) -> Tuple[int, ...]: ...
    @property
    def global_shape(self) -> Tuple[int, ...]: ...
    @property
    def global_offset(self) -> Tuple[int, ...]: ...
    @property
    def prepend_axis_num(self) -> int: ...
    @property
    def flattened_range(self) -> FlatRange: ...
    @property
    def allow_shape_mismatch(self) -> bool: ...
    @property
    def data_ptr(self) -> int: ...
    @property
    def nbytes(self) -> int: ...

@final
class SaveObject:
    """A shard of a sharded object to save: shard ``global_offset`` of a ``global_shape`` grid
    of shards, with its serialized ``data`` (``bytes`` or ``bytearray``; empty to validate the
    layout only). Made with keyword arguments."""

    def __new__(
        cls,
        *,
        key: str,
        global_shape: Shape,
        global_offset: Shape,
        replica_id: ReplicaId = 0,
        data: Union[bytes, bytearray, None] = None,
    ) -> "SaveObject": ...
    @property
    def key(self) -> str: ...
    @property
    def global_shape(self) -> Tuple[int, ...]: ...
    @property
    def global_offset(self) -> Tuple[int, ...]: ...
    @property
    def replica_id(self) -> Tuple[int, ...]: ...
    @property
    def data(self) -> bytes: ...

@final
class LoadObject:
    """A shard of a sharded object to load: shard ``global_offset`` of a ``global_shape`` grid."""

    def __new__(cls, *, key: str, global_shape: Shape, global_offset: Shape) -> "LoadObject": ...
    @property
    def key(self) -> str: ...
    @property
    def global_shape(self) -> Tuple[int, ...]: ...
    @property
    def global_offset(self) -> Tuple[int, ...]: ...

def from_rank_offsets(
    key: str, local_shape: Shape, rank_offsets: Sequence[Tuple[int, int, int]], prepend_axis_num: int = 0
) -> Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]:
    """``(global_shape, global_offset, axis_fragmentations)`` of Megatron's
    ``ShardedTensor.from_rank_offsets`` (the core's): each ``(axis, axis_rank_offset,
    axis_fragm)`` cuts global ``axis`` into ``axis_fragm`` equal chunks of which the shard is
    chunk ``axis_rank_offset``; axes below ``prepend_axis_num`` have size 1 in the box. Raises
    :class:`InvalidShardingError` naming the key."""

class Communicator(Protocol):
    """What ``comm`` must provide. Every rank calls the same collectives in the same order."""

    def rank(self) -> int: ...
    def world_size(self) -> int: ...
    def all_gather(self, data: bytes) -> List[bytes]: ...
    def broadcast(self, data: bytes, root: int) -> bytes: ...

__version__: str
FORMAT_VERSION: int
# What the Python package adds to the data model (FORMAT.md, "What the Python package adds").
OBJECT_TAG_VALUE: bytes
OBJECT_TAG_TORCH: bytes
OBJECT_TAG_TORCH_LIST: bytes
TORCH_SAVE_KEY: str
INT_KEY_PREFIX: str
DTYPES: List[str]

def save(
    tensors: Sequence[SaveTensor],
    objects: Sequence[SaveObject],
    common: Sequence[Tuple[Path, PlainValue]],
    location: LocationLike,
    comm: Optional[Communicator] = None,
    overwrite: bool = False,
    validate: bool = True,
    content_metadata: PlainValue = None,
    threads: Optional[int] = None,
    plan_cache: Optional["PlanCache"] = None,
) -> Dict[str, Union[int, Optional[str], List[str]]]:
    """Saves this rank's part (collective). Common values are written from rank 0.

    Returns ``{"file", "bytes_written", "total_tensor_bytes", "files", "chunks", "index_bytes",
    "leftovers"}`` (``leftovers``: files a committed save left for ``tessera gc``, with a
    ``RuntimeWarning``).
    """

@final
class PlanCache:
    """This rank's last global save plan, reused by a save whose structure is unchanged on every
    rank (one small all-gather instead of the plan exchange and validation). One per rank, kept
    across saves; every rank passes one or none."""

    def __init__(self) -> None: ...
    @property
    def hits(self) -> int: ...
    @property
    def misses(self) -> int: ...

@final
class AsyncSave:
    """One async save in flight."""

    def is_done(self) -> bool:
        """This rank's part is written and the commit decided (local, no communication)."""
    def finalize(self) -> Dict[str, Union[int, Optional[str], List[str]]]:
        """Waits; returns the report of :func:`save` or raises the save's error (same on every rank)."""

@final
class Restored:
    """What :meth:`CheckpointManager.restore` gave back (the tensors were filled in place)."""

    @property
    def step(self) -> int: ...
    @property
    def tier(self) -> str:
        """``"memory"`` or ``"persistent"``."""
    @property
    def rebuilt_ranks(self) -> List[int]: ...
    @property
    def notes(self) -> List[str]: ...
    @property
    def loaded(self) -> List[bool]: ...
    @property
    def objects(self) -> List[Optional[bytes]]: ...
    @property
    def common(self) -> List[Tuple[Path, PlainValue]]: ...

@final
class CheckpointManager:
    """Saves on a schedule to a memory tier (``memory_root``, RS(``data_shards``,
    ``parity_shards``) parity across nodes) and a ``persistent`` location; restores the newest
    complete step. ``background_comm`` runs the background collectives."""

    def __new__(
        cls,
        *,
        memory_root: Optional[str] = None,
        node: Optional[str] = None,
        data_shards: int = 4,
        parity_shards: int = 1,
        chunk_bytes: int = 8388608,
        persistent: Optional[LocationLike] = None,
        every: int = 1,
        persist_every: int = 0,
        keep_last_memory: int = 2,
        keep_last_persistent: int = 3,
        staging_bytes: int = 268435456,
        background_comm: Optional[Communicator] = None,
    ) -> "CheckpointManager": ...
    def save(
        self,
        step: int,
        tensors: Sequence[SaveTensor],
        objects: Sequence[SaveObject],
        common: Sequence[Tuple[Path, PlainValue]],
        comm: Optional[Communicator] = None,
    ) -> bool:
        """Saves ``step`` if the policy says so; returns once the bytes are staged."""
    def wait(self) -> None: ...
    def close(self) -> None: ...
    def restore(
        self, tensors: Sequence[LoadTensor], objects: Sequence[LoadObject], comm: Optional[Communicator] = None
    ) -> Optional[Restored]: ...

@final
class AsyncSaver:
    """Async saves through ``budget`` bytes of pre-faulted staging buffers, reused by every save.

    ``commit_comm`` runs the background commit and must be used by nothing else meanwhile.
    """

    def __new__(
        cls, budget: int, commit_comm: Optional[Communicator] = None, buffer_size: Optional[int] = None
    ) -> "AsyncSaver": ...
    def save(
        self,
        tensors: Sequence[SaveTensor],
        objects: Sequence[SaveObject],
        common: Sequence[Tuple[Path, PlainValue]],
        location: LocationLike,
        comm: Optional[Communicator] = None,
        overwrite: bool = False,
        validate: bool = True,
        content_metadata: PlainValue = None,
        threads: Optional[int] = None,
        plan_cache: Optional["PlanCache"] = None,
    ) -> AsyncSave:
        """Like :func:`save`, returning once the bytes are staged; a save in flight is waited for first."""
    def is_idle(self) -> bool: ...
    @property
    def capacity(self) -> int: ...
    @property
    def buffer_size(self) -> int: ...
    @property
    def peak_bytes_in_use(self) -> int: ...

def validate_sharding(
    tensors: Sequence[SaveTensor],
    objects: Sequence[SaveObject],
    comm: Optional[Communicator] = None,
) -> None:
    """Checks collectively, writing nothing, that the shards of all ranks form a valid state."""

@final
class TorchDistFile:
    """One data file of a planned ``torch_dist`` save."""

    @property
    def name(self) -> str:
        """The file's name, relative to the checkpoint."""
    def write(self) -> int:
        """Writes the file whole (any thread, GIL released); returns its size in bytes."""

@final
class TorchDistSave:
    """A planned ``torch_dist`` save: write every file of :meth:`files`, then :meth:`commit`."""

    def files(self) -> List[TorchDistFile]:
        """This rank's data files, in order (empty once committed)."""
    def commit(
        self, bytes_written: int, comm: Optional[Communicator] = None, failure: Optional[str] = None
    ) -> Dict[str, Union[int, Optional[str], List[str]]]:
        """Ends the save (collective): ``failure`` is this rank's error writing its files. With
        none on any rank, rank 0 commits; otherwise the save's files are removed and every rank
        raises the first failure (another rank's as ``PeerFailedError``)."""

def plan_torch_dist(
    tensors: Sequence[SaveTensor],
    objects: Sequence[SaveObject],
    common_pt: Optional[bytes],
    location: LocationLike,
    owners: Any,
    comm: Optional[Communicator] = None,
    overwrite: bool = False,
    validate: bool = True,
    threads: Optional[int] = None,
    files_per_rank: int = 1,
    common: Optional[Sequence[Tuple[Path, PlainValue]]] = None,
) -> TorchDistSave:
    """Plans a :func:`save_torch_dist` (collective; every check runs here), writing nothing.
    ``owners`` owns the tensors' memory and is held by the plan; that memory must stay
    unmodified until the save is committed or dropped."""

def cli(argv: List[str]) -> int:
    """Runs the ``tessera`` command line ``argv`` (program name first); returns its exit status."""

def save_torch_dist(
    tensors: Sequence[SaveTensor],
    objects: Sequence[SaveObject],
    common_pt: Optional[bytes],
    location: LocationLike,
    comm: Optional[Communicator] = None,
    overwrite: bool = False,
    validate: bool = True,
    threads: Optional[int] = None,
    files_per_rank: int = 1,
    common: Optional[Sequence[Tuple[Path, PlainValue]]] = None,
) -> Dict[str, Union[int, Optional[str], List[str]]]:
    """Saves this rank's part as a Megatron ``torch_dist`` checkpoint (collective): DCP
    ``.metadata`` (rank 0, last: the commit), ``files_per_rank`` files ``__{rank}_{k}.distcp``
    per rank (``k`` from 0 in a directory without data files, else numbers of this save's own,
    so a checkpoint being replaced stays whole until the commit), ``metadata.json`` and
    ``common.pt``, loadable by megatron-core and ``torch.distributed.checkpoint``.

    Tensors and objects as for :func:`save`; flattened ranges are refused (as megatron-core
    0.16.1 does). An object's payload becomes the byte item ``torch.save([obj])``: ``b"TSV1"`` +
    :func:`encode_value` bytes (a plain value), ``b"TPL1"`` + ``torch.save([obj])`` (stored as
    is), ``b"TPT1"`` + ``torch.save(obj)`` (wrapped in a list); any other payload is stored as
    ``bytes``. ``common_pt`` (read on rank 0) is the whole ``common.pt``, ``torch.save`` of the
    common dict; None makes it of ``common``. ``common`` (read on rank 0; ``(path, plain
    value)`` pairs, as :func:`save`'s) is also written as DCP's own save writes a state dict's
    values: byte items under DCP's flattened keys, their paths in ``planner_data``, which
    ``torch.distributed.checkpoint.load`` finds.

    Returns ``{"file", "bytes_written", "total_tensor_bytes", "files", "chunks", "index_bytes",
    "leftovers"}`` (``leftovers``: files a committed save left for ``tessera gc``, with a
    ``RuntimeWarning``)
    (``index_bytes``: the size of ``.metadata`` on rank 0, 0 elsewhere).
    """

def save_olmo(
    dirs: Sequence[Tuple[Sequence[SaveTensor], LocationLike]],
    comm: Optional[Communicator] = None,
    overwrite: bool = False,
    threads: Optional[int] = None,
) -> List[Dict[str, Union[int, str, List[str]]]]:
    """Saves this rank's tensors as OLMo-core 0.1.x ``Checkpointer`` directories, one per
    ``(tensors, location)`` (collective): a rank file per rank (``rank_{r}.safetensors`` in a
    directory without rank files, ``rank_{r}-{save id}.safetensors`` elsewhere, so that the
    checkpoint replaced stays whole until the commit), ``metadata.json`` from rank 0 last; every
    directory validated before any is written, committed in order. Identical shards held by
    several ranks are replicas, written once.

    Returns per directory ``{"files": List[str] (created by this rank, relative to it),
    "bytes_written": int, "metadata": str (the text of metadata.json), "leftovers": List[str]
    (files left for ``tessera gc``, with a ``RuntimeWarning``)}``."""

def olmo_metadata(location: LocationLike) -> str:
    """The text of an OLMo-core ``Checkpointer`` directory's ``metadata.json``, once checked."""

def load(
    tensors: Sequence[LoadTensor],
    objects: Sequence[LoadObject],
    location: LocationLike,
    comm: Optional[Communicator] = None,
    strict: str = "assume_ok_unexpected",
    verify: bool = True,
    threads: Optional[int] = None,
    exchange_reads: bool = False,
    cast_dtypes: bool = False,
) -> Dict[str, object]:
    """Loads into the tensors' memory and returns::

        {"objects": List[Optional[bytes]],   # by position; None if skipped as unexpected
         "loaded": List[bool],               # by position; False if skipped as unexpected
         "common": List[Tuple[Path, PlainValue]],
         "missing_keys": List[str], "unexpected_keys": List[str],
         "stats": {"bytes_needed", "bytes_read", "header_bytes_read", "reads"}}

    ``strict`` is a Megatron StrictHandling name: ``assume_ok_unexpected``, ``log_unexpected``,
    ``log_all``, ``raise_unexpected``, ``raise_all``, ``return_unexpected``, ``return_all``,
    ``ignore_all``.
    """

def load_objects_metadata(location: LocationLike) -> Dict[str, Tuple[Tuple[int, ...], List[Tuple[int, ...]]]]:
    """Key -> (grid shape, grid offset of every stored shard) of every stored object."""
    ...

def load_tensors_metadata(location: LocationLike) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
    """Key -> (dtype, global shape) of every stored tensor."""

def load_common(location: LocationLike) -> List[Tuple[Path, PlainValue]]:
    """The common state as (path, value) pairs (maps in key order)."""

def load_content_metadata(location: LocationLike) -> PlainValue:
    """The ``content_metadata`` given at save (None if none)."""

def load_objects(objects: Sequence[LoadObject], location: LocationLike) -> List[bytes]:
    """The bytes of the given object shards, in order."""

def remove_sharded_tensors(location: LocationLike, key_prefix: str) -> List[str]:
    """Removes every tensor whose key starts with ``key_prefix``; returns the keys removed."""

def verify(location: LocationLike, threads: Optional[int] = None) -> Dict[str, Union[int, List[str]]]:
    """Re-reads every file: ``{"files", "chunks", "bytes_checked", "problems": List[str]}``."""

def gc(location: LocationLike, break_leases: bool = False) -> Dict[str, Any]:
    """Removes the leftovers of saves that never committed or were replaced, beside running
    saves: ``{"removed": List[str], "running": [{"save_id", "writer", "expires_in_ms", "files",
    "unreadable"}], "kept": List[str]}``. ``break_leases`` asserts that no save is running."""

def read_file(location: LocationLike, name: str) -> Optional[bytes]:
    """The bytes of the file ``name`` of the checkpoint at ``location`` (a plain name; locally a
    regular file, no link followed), or None if it does not exist."""

@final
class CheckpointFormat:
    """What wrote a checkpoint, as the core recognised it."""

    @property
    def backend(self) -> str:
        """``tessera``, ``torch_dcp``, ``torch_dist``, ``olmo_core``, ``zarr``,
        ``olmo_safetensors`` or ``safetensors``."""
    @property
    def version(self) -> int: ...
    @property
    def is_dcp(self) -> bool:
        """A PyTorch DCP directory."""
    @property
    def is_megatron(self) -> bool:
        """It carries Megatron-Core's ``metadata.json``."""
    @property
    def is_native(self) -> bool:
        """tessera's own format."""

def detect(location: LocationLike) -> Optional[CheckpointFormat]:
    """The format of the checkpoint at ``location``, or None if there is none."""

def encode_value(value: PlainValue) -> bytes:
    """``value`` in the library's safe tagged encoding (data only, never code)."""

def decode_value(data: bytes) -> PlainValue:
    """The value :func:`encode_value` encoded; malformed bytes raise :class:`InvalidArgumentError`."""

class TesseraError(Exception):
    """Base class of every tessera error."""

class NotFoundError(TesseraError, FileNotFoundError):
    path: str

class NotCommittedError(TesseraError, FileNotFoundError):
    path: str

class AlreadyExistsError(TesseraError, FileExistsError):
    path: str

class CorruptError(TesseraError, ValueError):
    path: str
    reason: str

class IncompatibleVersionError(TesseraError, ValueError):
    found: str
    supported: str

class InvalidShardingError(TesseraError, ValueError):
    key: str
    reason: str

class NotCoveredError(TesseraError, KeyError):
    key: str
    region: str

class MismatchError(TesseraError, ValueError):
    key: str
    reason: str

class KeyMismatchError(TesseraError, KeyError):
    unexpected: List[str]
    missing: List[str]

class UnknownStrategyError(TesseraError, LookupError):
    backend: str
    version: int
    action: str

class InvalidArgumentError(TesseraError, ValueError):
    reason: str

class PeerFailedError(TesseraError, RuntimeError):
    rank: int
    message: str

class CommError(TesseraError, RuntimeError):
    reason: str

class StorageIOError(TesseraError, OSError):
    path: str
    reason: str

class AccessDeniedError(TesseraError, PermissionError):
    path: str
    reason: str

class CommitUnknownError(TesseraError, RuntimeError):
    path: str
    reason: str
