"""torch.compile caches as one file, so a new process reaches full speed without recompiling.

``torch.compiler.save_cache_artifacts()`` gathers what this process compiled (Inductor's FX graph
cache, AOTAutograd's cache, Triton kernels, autotuning results) into bytes; loading them in a new
process before its first compile turns every compile into a cache hit. Dynamo still traces the
model (seconds), but nothing is code-generated or autotuned again.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rapiddiff.infer.fast_report import FastPathReport, SwitchStatus
from rapiddiff.utils.io import atomic_write_bytes, atomic_write_text
from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)


def load_compile_cache(path: str | Path) -> str:
    """Load cache artifacts from ``path`` if it exists; returns a status line for the report."""
    path = Path(path)
    if not path.is_file():
        return f"missing: will write {path} after the first compiled run"
    info = torch.compiler.load_cache_artifacts(path.read_bytes())
    counts = _counts(info)
    log.info("loaded compile cache %s (%s)", path, counts)
    return f"loaded {path.name} ({path.stat().st_size / 2**20:.1f} MiB; {counts})"


def save_compile_cache(path: str | Path) -> str:
    """Write this process's compile artifacts to ``path``; returns a status line."""
    result = torch.compiler.save_cache_artifacts()
    if result is None:
        return "nothing to save (no compiled artifacts in this process)"
    data, info = result
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, data)
    log.info("saved compile cache %s (%.1f MiB)", path, len(data) / 2**20)
    return f"saved {path.name} ({len(data) / 2**20:.1f} MiB; {_counts(info)})"


def _counts(info: object) -> str:
    """Artifact counts by kind from a CacheInfo (its fields differ across torch versions)."""
    if info is None:
        return "no artifacts"
    parts = []
    for name in sorted(vars(info)) if hasattr(info, "__dict__") else []:
        value = getattr(info, name)
        if isinstance(value, list) and value:
            parts.append(f"{len(value)} {name.replace('_artifacts', '')}")
    return ", ".join(parts) or "artifacts"


def _table_path(path: str | Path) -> Path:
    return Path(str(path) + ".attention.json")


def save_backend_table(path: str | Path, table: dict[tuple[int, int, int], str]) -> None:
    """Write the per-shape SDPA backends beside the compile cache (they shape the traced graph)."""
    rows = [{"query": q, "key": k, "head_dim": d, "backend": b} for (q, k, d), b in sorted(table.items())]
    atomic_write_text(_table_path(path), json.dumps(rows, indent=1))


def load_backend_table(path: str | Path) -> dict[tuple[int, int, int], str]:
    """The table :func:`save_backend_table` wrote for ``path``, or {} if there is none."""
    file = _table_path(path)
    if not file.is_file():
        return {}
    try:
        rows = json.loads(file.read_text(encoding="utf-8"))
        return {(int(r["query"]), int(r["key"]), int(r["head_dim"])): str(r["backend"]) for r in rows}
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{file}: not an attention backend table ({err}); delete it to re-measure") from err


def compile_cache_file(path: str, report: FastPathReport) -> str:
    """The compile-cache file for the switches as applied: ``path`` itself when they are as by
    default, else the difference in its name (``cache.no-batch-time-proj.bin``), so a process never
    takes a cache written for another graph for its own (it would load, miss, never be rewritten)."""
    if report.is_on("batch_time_proj"):
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}.no-batch-time-proj{p.suffix}"))


class CompileCache:
    """The compile-cache file of one fast path: loaded before the first compile, written after the
    first compiled run when it was missing; its status is the report's "compile_cache" line."""

    def __init__(self, path: str, report: FastPathReport, backends: dict[tuple[int, int, int], str]) -> None:
        self.path, self.report, self.backends = compile_cache_file(path, report), report, backends
        self.missing = not Path(self.path).is_file()
        report.set("compile_cache", SwitchStatus("on", load_compile_cache(self.path)))
        # The attention backends are part of the traced graph: reuse the ones the cache was compiled
        # with, or a re-timed (noisy) choice would change the graph and miss the cache.
        backends.update(load_backend_table(self.path))

    def save_if_missing(self) -> None:
        if self.missing:
            self.missing = False
            self.report.set("compile_cache", SwitchStatus("on", save_compile_cache(self.path)))
            save_backend_table(self.path, self.backends)
