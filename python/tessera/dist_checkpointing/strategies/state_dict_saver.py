"""Megatron's two-phase DCP save (megatron-core's ``strategies.state_dict_saver``), by name.

tessera's core plans, writes and commits saves itself (plan exchange, one writer per chunk,
then a commit every rank agrees on); it does not go through torch DCP's planner. These functions
keep megatron's names and run the same phases through ``torch.distributed.checkpoint`` for code
that calls them with its own DCP writer and planner.

torch is an optional extra of the package, so it is imported where it is used, not with this
module.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

__all__ = ["save_state_dict_async_plan", "save_state_dict_async_finalize", "verify_global_md_reuse"]


def save_state_dict_async_plan(
    state_dict: Any,
    storage_writer: Any,
    process_group: Any = None,
    coordinator_rank: int = 0,
    planner: Any = None,
    cached_ckpt_structure: Optional[Tuple[Any, Any, bool]] = None,
    loaded_all_plans: Any = None,
) -> Tuple[Tuple[Any, Any, Any], Any, Any, Any]:
    """Saves ``state_dict`` with torch DCP (synchronously: the write is done on return) and
    returns megatron's tuple shape: ``((writer, metadata, None), central_plan, local_plan,
    cache_reuse)``."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.save(state_dict, storage_writer=storage_writer, planner=planner, process_group=process_group)
    return (storage_writer, metadata, None), None, None, False


def verify_global_md_reuse(loaded_all_plans: Any, local_plan: Any, rank: int, dist_wrapper: Any) -> bool:
    """Whether cached global metadata can be reused: tessera's core caches its own plan
    (``cached_metadata=True`` strategies), so DCP metadata is never reused here."""
    return False


def save_state_dict_async_finalize(storage_writer: Any, global_metadata: Any, dist_wrapper: Any) -> None:
    """Nothing is left to do: :func:`save_state_dict_async_plan` already committed."""
    return None
