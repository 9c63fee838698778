"""`tessera.torch.dcp`: ``torch.distributed.checkpoint``'s ``save``, ``async_save`` and ``load``
with DCP's own defaults, on tessera's engine, for code that reaches DCP through one name:

    import tessera.torch.dcp
    import torchtitan.components.checkpointer.dcp as titan

    titan.dcp = tessera.torch.dcp

Where :mod:`tessera.torch` chooses otherwise on purpose, this module chooses as DCP does:

- a save into a location that holds a checkpoint replaces it (``overwrite=True``; tessera.torch
  keeps it unless asked). The replaced checkpoint stays whole until the new one commits.
- what is written is a DCP directory (``format="dcp"``: ``.metadata``, written last, is the
  commit), so that whatever finds checkpoints by DCP's ``.metadata`` (torchtitan's resume from
  the latest step) finds these, and torch DCP itself loads their tensors.

Every other argument is :mod:`tessera.torch`'s, and may be given to override these.
"""

from __future__ import annotations

from typing import Any, Dict

from . import async_save as _async_save
from . import load as _load
from . import save as _save

__all__ = ["save", "async_save", "load"]


def save(state_dict: Dict[str, Any], **kwargs: Any) -> dict:
    """:func:`tessera.torch.save` with DCP's defaults (``overwrite=True``, ``format="dcp"``)."""
    kwargs.setdefault("overwrite", True)
    kwargs.setdefault("format", "dcp")
    return _save(state_dict, **kwargs)


def async_save(state_dict: Dict[str, Any], **kwargs: Any) -> Any:
    """:func:`tessera.torch.async_save` with DCP's defaults (``overwrite=True``,
    ``format="dcp"``); returns what DCP's returns (a future, or an ``AsyncSaveResponse``)."""
    kwargs.setdefault("overwrite", True)
    kwargs.setdefault("format", "dcp")
    return _async_save(state_dict, **kwargs)


def load(state_dict: Dict[str, Any], **kwargs: Any) -> None:
    """:func:`tessera.torch.load` (any format tessera reads: its own, DCP's, Hugging Face's)."""
    _load(state_dict, **kwargs)
