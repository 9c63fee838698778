"""The ``tessera`` command of the Python package (``pip install tessera`` puts it on PATH; also
``python -m tessera``). It is the Rust CLI itself, run in this process: no logic here."""

from __future__ import annotations

import signal
import sys
from typing import List, Optional

from . import _native


def main(argv: Optional[List[str]] = None) -> int:
    """Runs ``tessera ARGS...`` and returns its exit status (0 ok, 1 failure or difference, 2
    usage error)."""
    args = sys.argv if argv is None else ["tessera", *argv]
    # As the native binary: Ctrl-C stops the process, a closed pipe ends it quietly.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.stdout.flush()
    return _native.cli([str(a) for a in args])


def entry() -> None:
    """The console script's entry point."""
    sys.exit(main())
