"""Test servers on loopback (moto, Azurite): a free port, and a process started and waited for."""

from __future__ import annotations

import socket
import subprocess
import time
from typing import List


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_on_loopback(argv: List[str], port: int) -> subprocess.Popen:
    """Starts ``argv`` (output discarded) and waits until it accepts connections on
    ``127.0.0.1:port``."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 1).close()
            return proc
        except OSError:
            assert proc.poll() is None, f"{argv[0]} exited with {proc.returncode}"
            assert time.monotonic() < deadline, f"{argv[0]} did not start on port {port}"
            time.sleep(0.1)
