"""The ``tessera`` command as ``pip install`` gives it (the console script of the Python
package, running the Rust CLI in-process), used the way scripts and pipelines use it: a
subprocess with stdout and stderr captured (not a terminal). Also a save that fails for lack of
space (a file-size limit in the saving process) and a save into a directory that holds
something else."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from typing import Any, List

import pytest
import torch

import tessera.torch as tt
from tessera.errors import InvalidArgumentError, StorageIOError


def tessera(*args: str) -> subprocess.CompletedProcess:
    """Runs the console script (``python -m tessera`` when the script is not on PATH)."""
    script = shutil.which("tessera", path=os.path.dirname(sys.executable))
    cmd: List[str] = [script] if script else [sys.executable, "-m", "tessera"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=300)


@pytest.fixture()
def ckpt(tmp_path: Any) -> str:
    path = str(tmp_path / "ckpt")
    g = torch.Generator().manual_seed(1)
    tt.save({"model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)}, "step": 3}, path)
    return path


def test_console_script_is_the_rust_cli(ckpt: str) -> None:
    script = shutil.which("tessera", path=os.path.dirname(sys.executable))
    assert script is not None, "pip install puts `tessera` next to the interpreter"
    out = tessera("--version")
    assert out.returncode == 0 and out.stdout.startswith("tessera "), out
    out = tessera("inspect", ckpt)
    assert out.returncode == 0 and "model.w" in out.stdout and "step = 3" in out.stdout, out.stdout
    out = tessera("no-such-command")
    assert out.returncode == 2 and "unrecognized subcommand" in out.stderr, out.stderr


def test_verify_and_diff_speak_json_and_show_progress_without_a_terminal(ckpt: str, tmp_path: Any) -> None:
    out = tessera("verify", ckpt, "--json")
    report = json.loads(out.stdout)
    assert out.returncode == 0 and report["sound"] and report["checksummed"] and report["leftovers"] == []
    # Plain progress lines on a non-terminal stderr, first and last included.
    out = tessera("--progress", "0.01", "verify", ckpt)
    assert out.returncode == 0 and "sound" in out.stdout
    lines = [l for l in out.stderr.splitlines() if l.startswith("tessera: verify:")]
    assert len(lines) >= 2 and lines[-1].startswith("tessera: verify: 100%"), out.stderr
    assert "\r" not in out.stderr and "\x1b" not in out.stderr
    # Without --progress a short run prints nothing on a non-terminal.
    assert tessera("verify", ckpt).stderr == ""
    other = str(tmp_path / "other")
    tt.save({"model": {"w": torch.zeros(64, 32), "b": torch.zeros(32)}, "step": 4}, other)
    out = tessera("diff", ckpt, other, "--json")
    d = json.loads(out.stdout)
    assert out.returncode == 1 and not d["equal"]
    assert {t["key"] for t in d["tensors"]} == {"model.w", "model.b"} and d["common"], d
    assert json.loads(tessera("diff", ckpt, ckpt, "--json").stdout)["equal"]


def test_unshard_renames_for_hugging_face_and_refuses_a_budget_below_one_block(ckpt: str, tmp_path: Any) -> None:
    from safetensors.torch import load_file

    out_dir = tmp_path / "hf"
    out = tessera("unshard", ckpt, "--out", str(out_dir), "--max-shard-size", "8KiB", "--strip-prefix", "model.")
    assert out.returncode == 0, out.stderr
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == ["b", "w"]
    full = tt.unshard(ckpt)
    for name, file in index["weight_map"].items():
        assert torch.equal(load_file(str(out_dir / file))[name], full[f"model.{name}"])
    # --memory 0 is refused at once, naming the minimum; nothing is written.
    target = tmp_path / "out" / "x.safetensors"
    out = tessera("unshard", ckpt, "--out", str(target), "--memory", "0")
    assert out.returncode == 1 and "below the minimum of 1048576 bytes" in out.stderr, out.stderr
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


def test_messages_say_what_was_looked_for(tmp_path: Any) -> None:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("hello")
    out = tessera("inspect", str(tmp_path / "notes"))
    assert out.returncode == 1
    assert "no checkpoint in" in out.stderr and "found neither tessera.index" in out.stderr, out.stderr
    assert "readme.txt" in out.stderr
    out = tessera("verify", str(tmp_path / "absent"), "--json")
    assert out.returncode == 1 and "no such directory" in json.loads(out.stdout)["error"]


FULL_DISK = textwrap.dedent(
    """
    import resource, signal, sys, torch
    import tessera.torch as tt
    # The disk "fills" after 64 KiB: larger writes fail with EFBIG (SIGXFSZ ignored).
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
    try:
        tt.save({"w": torch.ones(1 << 20)}, sys.argv[1])
    except Exception as e:
        print(type(e).__name__, e)
    """
)


def test_a_save_that_runs_out_of_space_removes_what_it_wrote(tmp_path: Any) -> None:
    path = tmp_path / "full"
    out = subprocess.run([sys.executable, "-c", FULL_DISK, str(path)], capture_output=True, text=True, timeout=300)
    assert out.stdout.startswith("StorageIOError"), (out.stdout, out.stderr)
    assert not path.exists() or os.listdir(path) == [], os.listdir(path)
    assert issubclass(StorageIOError, OSError)


def test_a_save_into_a_directory_holding_other_files_is_refused_unless_overwrite(tmp_path: Any) -> None:
    path = tmp_path / "busy"
    path.mkdir()
    (path / "notes.txt").write_text("mine")
    with pytest.raises(InvalidArgumentError, match="notes.txt"):
        tt.save({"w": torch.ones(3)}, str(path))
    assert os.listdir(path) == ["notes.txt"]
    tt.save({"w": torch.ones(3)}, str(path), overwrite=True)
    assert (path / "notes.txt").read_text() == "mine"
    sd = {"w": torch.zeros(3)}
    tt.load(sd, str(path))
    assert sd["w"].tolist() == [1.0, 1.0, 1.0]


def test_the_readme_quickstart_runs(tmp_path: Any) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "quickstart.py")
    out = subprocess.run(
        [sys.executable, example, str(tmp_path / "qs"), str(port)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "100 [9.0, 10.0, 11.0]", out.stdout
    assert tessera("verify", str(tmp_path / "qs")).returncode == 0
