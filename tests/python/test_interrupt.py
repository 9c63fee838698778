"""Ctrl-C during a long save or load stops it promptly, raises KeyboardInterrupt, and leaves
nothing committed (save) — run in a child process so a late signal cannot hit pytest."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    import numpy as np
    from tessera import _native

    ckpt, phase = sys.argv[1], sys.argv[2]
    data = np.ones(1 << 29, dtype=np.uint8)  # 512 MiB: seconds of IO on this machine
    n = 1 << 29
    spec = _native.SaveTensor(key="w", dtype="u8", local_shape=(n,), global_shape=(n,), global_offset=(0,),
                              data_ptr=data.ctypes.data, nbytes=data.nbytes)
    if phase == "load":
        _native.save([spec], [], [], ckpt, None)
    threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    start = time.monotonic()
    try:
        if phase == "save":
            _native.save([spec], [], [], ckpt, None)
        else:
            out = np.zeros_like(data)
            req = _native.LoadTensor(key="w", dtype="u8", local_shape=(n,), global_shape=(n,), global_offset=(0,),
                                     data_ptr=out.ctypes.data, nbytes=out.nbytes)
            _native.load([req], [], ckpt, None)
        print("finished", time.monotonic() - start)
    except KeyboardInterrupt:
        print("interrupted", time.monotonic() - start)
    """
)


def run(tmp_path: Path, phase: str) -> str:
    ckpt = tmp_path / phase
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(ckpt), phase], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_ctrl_c_interrupts_a_save_and_nothing_is_committed(tmp_path: Path) -> None:
    out = run(tmp_path, "save")
    assert out.startswith("interrupted"), out
    assert not (tmp_path / "save" / "tessera.index").exists()


def test_ctrl_c_interrupts_a_load(tmp_path: Path) -> None:
    out = run(tmp_path, "load")
    assert out.startswith("interrupted"), out
