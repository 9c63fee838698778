"""File helpers the Python benchmarks share (imported by the other scripts/bench/bench_*.py, which run from
their own folder): durable writes, listings, and dropping files from the page cache so that a
read that follows comes from the disk."""

from __future__ import annotations

import os
from typing import List


def fsync_path(path: str) -> None:
    """fsync of a file or directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def files_under(path: str) -> List[str]:
    """Every file below ``path``, sorted."""
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)


def drop_cache(*paths: str) -> None:
    """Writes everything back (``os.sync``: clean pages can be dropped), then evicts every file
    below each of ``paths`` from the page cache."""
    os.sync()
    for path in paths:
        for file in files_under(path):
            fd = os.open(file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def write_all(fd: int, view: memoryview) -> None:
    """Writes all of ``view`` to ``fd`` (``os.write`` may write less than asked)."""
    while view:
        n = os.write(fd, view)
        view = view[n:]
