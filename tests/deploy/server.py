"""A real uvicorn server on loopback, in a background thread, for the HTTP tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).parent / "kvroute"


@contextlib.contextmanager
def running(app: Any) -> Iterator[str]:
    """Serve ``app`` on 127.0.0.1 until the block ends; yields the base URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def start_cli(args: list[str], ready: str, timeout_s: float = 240) -> tuple[subprocess.Popen, list[str]]:
    """Start the installed script; return once it printed a line containing ``ready``.
    Its output keeps being read into the returned list (a full pipe would stall it)."""
    proc = subprocess.Popen(
        [str(SCRIPT), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO.parent,
        env=os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"},
    )
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if ready in line:
            threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
            return proc, lines
    proc.kill()
    raise AssertionError(f"{args[0]} never became ready:\n{''.join(lines)}")


def stop_cli(proc: subprocess.Popen, lines: list[str]) -> str:
    """Ctrl-C the script and wait for it; returns everything it printed."""
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)
    time.sleep(0.2)  # the reader thread takes the last lines
    return "".join(lines)
