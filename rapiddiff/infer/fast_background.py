"""The fast path's AOTInductor packages by default: built once in a background process, loaded next time.

With ``aoti="auto"`` (what ``rapiddiff generate --fast`` and ``rapiddiff serve --fast`` use) a
package that is missing or stale for its key (weights fingerprint, GPU, torch, shapes, switches:
:func:`rapiddiff.infer.fast_aoti.package_key`) is not built in the calling process. This process
runs torch.compile as before, and ``rapiddiff accelerate export`` for exactly its shapes and
switches is started in a detached, lower-priority process; the next process finds the packages and
loads them (12.9 s to full speed instead of 30–54 s, SD 1.5 on an H200).

Why a process, not a thread: the export traces the very modules the foreground is compiling and
running (a thread would race it on their compiled wrappers and on the GIL), a crash in native
code must not take a server down, and a detached process finishes its build after a short
``generate`` has exited. One build at a time per package folder (``build.lock``, with the pid);
the outcome of the last one (``build-last.json``) keeps a build that failed for a key from being
retried by every new process — the report says why and what to run instead.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rapiddiff.infer.fast_report import SwitchStatus, fallback
from rapiddiff.utils.io import atomic_write_text
from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)

LOCK = "build.lock"
LAST = "build-last.json"
LOG = "build.log"
# Devices whose fast path starts background builds: on a CPU the fast path is slower than eager
# (``generate --fast`` runs eager there), and a C++ build would take the cores the caller uses.
BACKGROUND_DEVICES = ("cuda",)
# Measured: `rapiddiff accelerate export` of SD 1.5 (860 M U-Net parameters), batch 1 with guidance,
# 512², on an H200: 182 s. Compile time grows with the graph more than with the parameters, so the
# estimate for other sizes is rough (and said to be).
MEASURED_S, MEASURED_PARAMS = 182.0, 860e6
LOCK_MAX_AGE_S = 3600.0  # a lock older than this is a build that died without removing it


@dataclass(frozen=True)
class BuildRequest:
    """One ``rapiddiff accelerate export`` call: a model, a device, one image size and sampler, the
    switches as given (the batch sizes are merged across requests)."""

    model: str
    folder: str
    device: str
    height: int
    width: int
    guidance: bool
    sampler: str | None
    switches: tuple[str, ...]
    batch: int
    keys: str = field(default="", compare=False)  # digest of the wanted package keys

    def group(self) -> tuple[Any, ...]:
        return (
            self.model,
            self.folder,
            self.device,
            self.height,
            self.width,
            self.guidance,
            self.sampler,
            self.switches,
        )


def keys_digest(keys: list[dict[str, Any]]) -> str:
    """What identifies a build's target: the wanted package keys (weights included), hashed."""
    text = json.dumps(keys, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def export_argv(requests: list[BuildRequest]) -> list[str]:
    """The ``rapiddiff accelerate export`` arguments building every request (one group)."""
    first = requests[0]
    batches = sorted({r.batch for r in requests})
    argv = ["export", "--model", first.model, "--dir", first.folder, "--device", first.device]
    argv += ["--batch", *map(str, batches), "--height", str(first.height), "--width", str(first.width)]
    # Any scale > 1 doubles the U-Net batch (classifier-free guidance); the value is no part of a package.
    argv += ["--guidance", "2" if first.guidance else "1"]
    if first.sampler:
        argv += ["--scheduler", first.sampler]  # the timesteps' dtype is part of the key
    if first.switches:
        argv += ["--switches", *first.switches]
    return argv


def estimate_s(unet_params: int) -> float:
    """Rough seconds an export of a U-Net of ``unet_params`` takes on an H200 (see MEASURED_S)."""
    return MEASURED_S * max(0.2, unet_params / MEASURED_PARAMS)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def live_lock(folder: Path) -> dict[str, Any] | None:
    """The lock of a build running for ``folder`` (its pid alive, not older than LOCK_MAX_AGE_S), else None."""
    file = folder / LOCK
    try:
        info = json.loads(file.read_text(encoding="utf-8"))
        pid, started = int(info["pid"]), float(info["started"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if _alive(pid) and time.time() - started < LOCK_MAX_AGE_S:
        return info
    return None


def failed_before(folder: Path, digest: str) -> dict[str, Any] | None:
    """The last build's record if it was for ``digest``: asked for again, it failed or left the
    package stale (a package it built that matches is loaded, never asked for)."""
    try:
        last = json.loads((folder / LAST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if isinstance(last, dict) and digest in last.get("keys", []):
        return last
    return None


def spawn(argv: list[str], folder: Path) -> subprocess.Popen:
    """Start the builder process, detached (a new session: it outlives a short ``generate``)."""
    folder.mkdir(parents=True, exist_ok=True)
    logfile = open(folder / LOG, "wb")  # noqa: SIM115 - the child writes it; closed here after the fork
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "rapiddiff.infer.fast_background", *argv],
            stdin=subprocess.DEVNULL,
            stdout=logfile,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONFAULTHANDLER": "1"},
        )
    finally:
        logfile.close()


class BackgroundBuilds:
    """The background package builds one fast path asks for: at most one process at a time per
    folder; requests that arrive while it runs are started together when it ends."""

    def __init__(self, folder: Path, unet_params: int) -> None:
        self.folder, self.unet_params = folder, unet_params
        self.pending: dict[BuildRequest, None] = {}
        self.proc: subprocess.Popen | None = None
        self._mutex = threading.Lock()

    def request(self, req: BuildRequest) -> SwitchStatus:
        """Ask for ``req``'s packages; returns the report status (what runs now, and why)."""
        last = failed_before(self.folder, req.keys)
        if last is not None:
            return fallback(
                f"the background build for this key ended with exit {last.get('rc')} and left the package "
                f"missing or stale (see {self.folder / LOG}); run `rapiddiff accelerate "
                f"{' '.join(export_argv([req]))}` to see why, or delete {self.folder / LAST} to retry",
                "torch.compile",
            )
        with self._mutex:
            self.pending[req] = None
            mine = self.proc is not None and self.proc.poll() is None
            other = None if mine else live_lock(self.folder)
            if mine or other is not None:
                pid = self.proc.pid if mine else other["pid"]  # type: ignore[index, union-attr]
                return fallback(
                    f"packages being built in the background (pid {pid}, log {self.folder / LOG}); "
                    "a later process loads them",
                    "torch.compile",
                )
            return self._start()

    def _start(self) -> SwitchStatus:
        """Start one export for the first group of pending requests (the caller holds the mutex)."""
        group = next(iter(self.pending)).group()
        batch = [r for r in self.pending if r.group() == group]
        for r in batch:
            del self.pending[r]
        argv = [json.dumps(sorted({r.keys for r in batch})), *export_argv(batch)]
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            if live_lock(self.folder) is None:  # a dead build's lock: take it over
                (self.folder / LOCK).unlink(missing_ok=True)
            fd = os.open(self.folder / LOCK, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:  # another process took it a moment ago
            return fallback("packages being built by another process", "torch.compile")
        except OSError as err:
            return fallback(f"cannot write {self.folder} ({err.strerror}); pass aoti_dir", "torch.compile")
        os.close(fd)
        self.proc = spawn(argv, self.folder)
        atomic_write_text(self.folder / LOCK, json.dumps({"pid": self.proc.pid, "started": time.time()}))
        minutes = estimate_s(self.unet_params) / 60
        sizes = ", ".join(f"batch {r.batch}" for r in batch)
        log.warning(
            "fast path: building its AOTInductor packages in the background (%s, %dx%d; pid %d, log %s): "
            "once per model, GPU, torch version and switches, about %.0f min on an H200 (3 min at SD 1.5 "
            "size); this process runs torch.compile meanwhile, the next one loads the packages",
            sizes, batch[0].width, batch[0].height, self.proc.pid, self.folder / LOG, max(1.0, minutes),
        )  # fmt: skip
        threading.Thread(target=self._after, args=(self.proc,), daemon=True, name="rapiddiff-aoti").start()
        return fallback(
            f"building in the background (pid {self.proc.pid}, about {max(1.0, minutes):.0f} min, log "
            f"{self.folder / LOG}); a later process loads the packages",
            "torch.compile",
        )

    def _after(self, proc: subprocess.Popen) -> None:
        """When our build ends: start the requests that came in meanwhile (while this process lives)."""
        proc.wait()
        with self._mutex:
            if self.pending and live_lock(self.folder) is None:
                self._start()

    def running(self) -> int | None:
        """The pid of this process's build still running, or None."""
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None


def main(argv: list[str] | None = None) -> int:
    """The builder process: ``KEYS_JSON export ARGS...``. Runs the export at a lower priority, writes
    ``build-last.json`` (exit status, the wanted keys) and removes the lock, whatever happens."""
    from rapiddiff.infer import accelerate_cli
    from rapiddiff.utils.logging import setup_logging

    argv = list(sys.argv[1:] if argv is None else argv)
    keys, rest = json.loads(argv[0]), argv[1:]
    with contextlib.suppress(OSError):
        os.nice(10)  # the foreground process compiles and serves: it goes first
    parser = argparse.ArgumentParser(prog="rapiddiff accelerate")
    accelerate_cli.register(parser)
    args = parser.parse_args(rest)
    setup_logging(0)
    folder = Path(args.dir)
    rc = 1
    try:
        rc = args.func(args)
    finally:
        # A failed build is remembered for its keys, so new processes do not start it over and over.
        # Success too: a build that left its package stale (nothing loads it) must not be started again.
        record = {"rc": rc, "keys": keys, "finished": time.time(), "argv": rest}
        with contextlib.suppress(OSError):
            atomic_write_text(folder / LAST, json.dumps(record, indent=1))
        with contextlib.suppress(OSError):
            (folder / LOCK).unlink()
    return rc


if __name__ == "__main__":
    sys.exit(main())
