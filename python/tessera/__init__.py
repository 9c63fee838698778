"""tessera: distributed checkpointing for large-model training (Python package)."""

from . import _native, errors
from ._native import Location
from .errors import TesseraError

__version__ = _native.__version__

__all__ = ["Location", "TesseraError", "errors", "__version__"]
