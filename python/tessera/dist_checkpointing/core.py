"""Checkpoint-level metadata: the package's base exception and the checkpoint config.

Megatron-Core keeps a ``metadata.json`` next to the data to say which backend wrote a
checkpoint. A tessera checkpoint describes itself through its committed index, so the config is
derived from what the native reader recognises (``tessera._native.detect``) instead of a
separate file. Foreign checkpoints that tessera reads keep their own description: Megatron's
``torch_dist`` and ``zarr`` checkpoints their ``metadata.json``; PyTorch DCP (``torch_dcp``) and
OLMo-core (``olmo_core``) checkpoints have none, so their config names the detected backend.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any, Optional, Union

from .. import _native

# One base class for every error of the package, native or Python: catching
# CheckpointingException also catches what the Rust core raises (NotFoundError, ...).
from ..errors import TesseraError as CheckpointingException
from .._core.storage import local_dir, native_location

__all__ = [
    "CheckpointingException",
    "CheckpointingValueError",
    "CheckpointingConfig",
    "maybe_load_config",
    "check_is_distributed_checkpoint",
    "save_config",
    "CONFIG_FNAME",
    "COMMON_STATE_FNAME",
]

class CheckpointingValueError(CheckpointingException, ValueError):
    """An invalid value in a (sharded) state dict.

    Also a ValueError because Megatron-Core raises ValueError in the same places (merging
    dicts, replacing key prefixes), and code written against it catches that.
    """


@dataclass
class CheckpointingConfig:
    """Documents the backends used in a checkpoint.

    ``sharded_backend`` stores the sharded tensors and objects, ``common_backend`` the other
    values. Versions describe the checkpoint format, not its (application specific) content.
    """

    sharded_backend: str
    sharded_backend_version: int = 1
    common_backend: str = "tessera"
    common_backend_version: int = 1


PathLike = Union[str, "os.PathLike[str]"]


def _detect(checkpoint_dir: PathLike) -> Optional[_native.CheckpointFormat]:
    try:
        return _native.detect(native_location(checkpoint_dir))
    except FileNotFoundError:
        # Megatron answers "not a distributed checkpoint" for a missing directory, not an error.
        return None


MEGATRON_CONFIG_FNAME = "metadata.json"
#: Megatron's name for it.
CONFIG_FNAME = MEGATRON_CONFIG_FNAME
#: The file of a Megatron checkpoint's common state (``torch.save`` of it), beside metadata.json;
#: Megatron's ``strategies.common`` names it too.
COMMON_STATE_FNAME = "common.pt"


def _megatron_config(checkpoint_dir: PathLike) -> Optional[CheckpointingConfig]:
    """What the checkpoint's own ``metadata.json`` says (None if it has none readable here)."""
    if local_dir(checkpoint_dir) is None:
        return None
    try:
        # Read by the core, as every checkpoint file is: never through a link out of the directory.
        data = _native.read_file(native_location(checkpoint_dir), MEGATRON_CONFIG_FNAME)
        return None if data is None else CheckpointingConfig(**json.loads(data))
    except (OSError, ValueError, TypeError, CheckpointingException):
        return None


def maybe_load_config(checkpoint_dir: PathLike) -> Optional[CheckpointingConfig]:
    """The config of the checkpoint at ``checkpoint_dir``, or None if it is not a distributed
    checkpoint that tessera recognises."""
    detected = _detect(checkpoint_dir)
    if detected is None:
        # Not a format the core detects: a checkpoint written by a caller's own strategy still
        # describes itself in metadata.json, as Megatron's do.
        return _megatron_config(checkpoint_dir)
    backend, version = detected.backend, detected.version
    if detected.is_megatron:
        config = _megatron_config(checkpoint_dir)
        if config is not None:
            return config
    if detected.is_dcp and not detected.is_megatron:
        # Non-tensor values are byte items of the same DCP checkpoint (torch_dist keeps
        # Megatron's torch-pickled common state: below).
        return CheckpointingConfig(
            sharded_backend=backend,
            sharded_backend_version=version,
            common_backend=backend,
            common_backend_version=version,
        )
    # tessera commits the common state in the same index as the shards (same format version);
    # other formats keep Megatron's torch-pickled common state.
    native = detected.is_native
    return CheckpointingConfig(
        sharded_backend=backend,
        sharded_backend_version=version,
        common_backend=backend if native else "torch",
        common_backend_version=version if native else 1,
    )


def check_is_distributed_checkpoint(checkpoint_dir: PathLike) -> bool:
    """True if ``checkpoint_dir`` holds a committed distributed checkpoint."""
    return maybe_load_config(checkpoint_dir) is not None


def save_config(config: CheckpointingConfig, checkpoint_dir: PathLike) -> None:
    """Writes ``config`` to ``<checkpoint_dir>/metadata.json`` (Megatron's description of a
    checkpoint). tessera's own saves never need it (the committed index describes the
    checkpoint, and the core writes ``metadata.json`` of ``torch_dist``); it is written for
    checkpoints whose sharded part a caller's own strategy wrote."""
    path = os.path.join(local_dir(checkpoint_dir) or os.fspath(checkpoint_dir), CONFIG_FNAME)
    with open(path, "w") as f:
        json.dump(asdict(config), f)
