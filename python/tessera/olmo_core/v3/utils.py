"""OLMo-core 3.x's ``olmo_core.distributed.checkpoint.utils``: its helpers that reshape loaded
tensors for one of its models (the shared-to-per-head QK-norm gain migration its DDP train
module runs), which are model logic and no part of reading or writing a checkpoint.

They are OLMo-core's own functions, taken from the installed ``olmo_core`` package (whose
module this package stands in for, so the file is loaded by its path), so that
``from olmo_core.distributed.checkpoint.utils import ...`` keeps working under the alias.
Without ai2-olmo-core installed they raise ``ImportError`` when used.
"""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType
from typing import Any, Optional

__all__ = ["prepare_qk_expansion", "finish_qk_expansion"]

_loaded: Optional[ModuleType] = None


def _olmo_utils() -> ModuleType:
    """OLMo-core's ``distributed/checkpoint/utils.py``, loaded once by its file path."""
    global _loaded
    if _loaded is None:
        spec = importlib.util.find_spec("olmo_core")
        roots = list(spec.submodule_search_locations or []) if spec is not None else []
        path = next((os.path.join(r, "distributed", "checkpoint", "utils.py") for r in roots), None)
        if path is None or not os.path.isfile(path):
            raise ImportError("olmo_core.distributed.checkpoint.utils: ai2-olmo-core is not installed")
        file_spec = importlib.util.spec_from_file_location("tessera.olmo_core.v3._olmo_core_utils", path)
        assert file_spec is not None and file_spec.loader is not None
        module = importlib.util.module_from_spec(file_spec)
        file_spec.loader.exec_module(module)
        _loaded = module
    return _loaded


def prepare_qk_expansion(*args: Any, **kwargs: Any) -> Any:
    """OLMo-core's ``prepare_qk_expansion``."""
    return _olmo_utils().prepare_qk_expansion(*args, **kwargs)


def finish_qk_expansion(*args: Any, **kwargs: Any) -> Any:
    """OLMo-core's ``finish_qk_expansion``."""
    return _olmo_utils().finish_qk_expansion(*args, **kwargs)
