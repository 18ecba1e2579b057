"""Live servers for the serve tests: `rapiddiff serve` in a subprocess, or the app in a thread.

Everything listens on 127.0.0.1 on a free port; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import rapiddiff

# The serve tests run on the built-in kshapes model by name (small, and its prompts are theirs),
# whichever built-in model is the default.
MODEL = "builtin:kshapes"
# Few steps and no upscaling: about a second an image on CPU.
FAST_FLAGS = ["--model", MODEL, "--steps", "2", "--no-upscale"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(url: str, timeout: float = 240, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(
                f"the server exited with {proc.returncode}:\n{proc.stdout.read() if proc.stdout else ''}"
            )
        with contextlib.suppress(httpx.HTTPError):
            response = httpx.get(f"{url}/ready", timeout=5)
            if response.status_code == 200:
                return
            if response.status_code == 500:
                raise RuntimeError(f"the model failed to load: {response.text}")
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout} s")


@contextlib.contextmanager
def serve_process(*flags: str, log: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """``rapiddiff serve`` as a user runs it; stopped with SIGTERM (graceful) at the end."""
    port = free_port()
    cmd = [sys.executable, "-m", "rapiddiff", "serve", "--host", "127.0.0.1", "--port", str(port), *flags]
    env = {**os.environ, "PYTHONPATH": str(Path(rapiddiff.__file__).parents[1])}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_ready(url, proc=proc)
        except Exception as err:
            raise RuntimeError(f"{err}\n--- server log ---\n{log.read_text()[-4000:]}") from err
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One `rapiddiff serve` for the API tests: builtin:kshapes, batches of up to 4, 400 ms wait."""
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with serve_process(*FAST_FLAGS, "--max-batch", "4", "--max-wait-ms", "400", log=log) as (url, _):
        yield url


@contextlib.contextmanager
def serve_in_thread(app: object) -> Iterator[str]:
    """The app under uvicorn in a thread of this process (for tests that wrap the engine)."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=120)


def metric(text: str, name: str) -> float:
    """The value of one sample (``name`` with its labels, exactly) in Prometheus text."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise KeyError(f"{name} not in metrics")
