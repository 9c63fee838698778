"""What a fresh install needs: the declared dependencies, and the quickstart on torch alone."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_quickstart_runs_without_numpy(tmp_path: Any) -> None:
    """torch does not depend on numpy, and torch without numpy cannot call ``.numpy()``: the
    communicator must not need it (it did: "Numpy is not available" on the first save)."""
    blocker = tmp_path / "blocked" / "numpy"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text(
        'raise ModuleNotFoundError("No module named numpy (blocked for the test)", name="numpy")\n'
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(blocker.parent), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py"), str(tmp_path / "ckpt"), str(_free_port())],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "100 [9.0, 10.0, 11.0]"


def test_the_package_declares_what_it_imports() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(d.split(">")[0].split("=")[0].strip() == "numpy" for d in project["dependencies"])
    torch_extra = project["optional-dependencies"]["torch"]
    assert any(d.startswith("torch") for d in torch_extra)
