"""AOTInductor packages of the fast path's U-Net and VAE decoder: compiled once, loaded in a new process.

A package (``torch.export`` + ``aoti_compile_and_package``, no weights inside: on load it reads the
live module's parameters) spares a new process Dynamo's tracing. One package per part, shape and
device in ``<model folder>/accelerated/``, beside a manifest holding the key it was built for;
:func:`check_package` compares that key field by field (versions, device, dtype, shapes, switches,
Inductor options, weights hash, constant layout) and the file's SHA-256 before any load, and a new
package is opened in a fresh process (:func:`check_loads`) before it is kept.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from rapiddiff.infer import aoti_toolchain
from rapiddiff.infer.fast_report import SwitchStatus, fallback
from rapiddiff.models import sampling
from rapiddiff.utils.io import atomic_write_text
from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)

FORMAT = 1
PACKAGE_DIR = "accelerated"
MODES = ("off", "load", "build", "auto")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")
# Where each part's weights live in a diffusers-layout model folder.
PART_FOLDERS = {"unet": "unet", "decoder": "vae"}
# The Inductor options every package is built with (part of the key: other options, other code).
INDUCTOR_CONFIGS: dict[str, Any] = {"aot_inductor.package_constants_in_so": False}
# Diagnostics only: a JSON object of Inductor options merged over those (e.g. weights inside the
# package). They enter the key like any option, so a package built with others is stale, never loaded.
INDUCTOR_ENV = "RAPIDDIFF_AOTI_INDUCTOR"


def inductor_configs() -> dict[str, Any]:
    """:data:`INDUCTOR_CONFIGS` with the :data:`INDUCTOR_ENV` override applied."""
    text = os.environ.get(INDUCTOR_ENV, "").strip()
    if not text:
        return dict(INDUCTOR_CONFIGS)
    try:
        extra = json.loads(text)
    except ValueError as err:
        raise PackageError(f"{INDUCTOR_ENV}: not a JSON object ({err})") from err
    if not isinstance(extra, dict):
        raise PackageError(f"{INDUCTOR_ENV}: not a JSON object: {text[:80]}")
    return {**INDUCTOR_CONFIGS, **extra}


class PackageError(RuntimeError):
    """A package that cannot be used here; the message says why and what to do."""


# ---- the key ----------------------------------------------------------------------------------------
@functools.cache
def loaded_libstdcxx() -> str | None:
    """The real path of the ``libstdc++`` this process has mapped, or None (none, or not Linux).
    Read once: torch (imported above) has mapped it before the first call, and it stays."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        if "libstdc++.so" in line:
            return os.path.realpath(line.split()[-1])
    return None


def device_fields(device: torch.device) -> dict[str, str | None]:
    """What the compiled code is specific to about this machine: GPU name and capability, or CPU ISA,
    and the C++ runtime."""
    # The C++ runtime too: a package's wrapper code runs against the libstdc++ it is loaded into.
    runtime = loaded_libstdcxx()
    libstdcxx = os.path.basename(runtime) if runtime else None
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return {
            "device": torch.cuda.get_device_name(device),
            "capability": f"sm_{major}{minor}",
            "cuda": torch.version.cuda,
            "libstdcxx": libstdcxx,
        }
    return {
        "device": f"cpu {platform.machine()}",
        "capability": torch.backends.cpu.get_cpu_capability(),
        "cuda": None,
        "libstdcxx": libstdcxx,
    }


def package_key(
    part: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    shapes: dict[str, Any],
    switches: dict[str, Any],
    weights: str,
) -> dict[str, Any]:
    """Everything a package is valid for (compared field by field by :func:`check_package`)."""
    return {
        "format": FORMAT,
        "part": part,
        "torch": torch.__version__,
        **device_fields(device),
        "dtype": str(dtype).removeprefix("torch."),
        "shapes": shapes,
        "switches": switches,
        "inductor": inductor_configs(),
        "weights": weights,
    }


def package_path(folder: Path, key: dict[str, Any]) -> Path:
    """The file a key's package lives in: part, shapes and device in the name (they may co-exist)."""
    shapes = "-".join(
        _slug(name[0] + "x".join(str(d) for d in shape))
        for name, shape in sorted(key["shapes"].items())
        if isinstance(shape, list)
    )
    return folder / f"{key['part']}-{shapes}-{_slug(str(key['device']))}.pt2"


def manifest_path(path: Path) -> Path:
    return path.with_suffix(".json")


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


# ---- weights fingerprint ----------------------------------------------------------------------------
def weights_fingerprint(
    root: Path, subfolder: str | None = None, known: dict[str, dict[str, Any]] | None = None
) -> tuple[str, dict[str, dict[str, Any]]]:
    """SHA-256 over the weights files of ``root/subfolder`` (or all of ``root`` but ``accelerated/``).

    Returns (digest, per-file records). A file whose size and mtime match its record in ``known``
    (the manifest's) keeps its recorded hash, so a new process does not re-read gigabytes to check
    a package; any other file is hashed again.
    """
    base = root / subfolder if subfolder and (root / subfolder).is_dir() else root
    files = sorted(
        p
        for p in base.rglob("*")
        if p.is_file() and p.suffix in WEIGHT_SUFFIXES and PACKAGE_DIR not in p.relative_to(root).parts
    )
    if not files:
        raise PackageError(f"{base}: no weights files ({', '.join(WEIGHT_SUFFIXES)}) to fingerprint")
    known = known or {}
    records: dict[str, dict[str, Any]] = {}
    total = hashlib.sha256()
    for file in files:
        rel = file.relative_to(root).as_posix()
        stat = file.stat()
        old = known.get(rel)
        if old and old.get("size") == stat.st_size and old.get("mtime_ns") == stat.st_mtime_ns:
            digest = str(old["sha256"])
        else:
            digest = _sha256(file)
        records[rel] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest}
        total.update(f"{rel}\0{digest}\n".encode())
    return total.hexdigest()[:32], records


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


# ---- constants (the live weights the package reads) -------------------------------------------------
def live_constants(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``module`` by its fully qualified name (aliases included)."""
    found = dict(module.named_parameters(remove_duplicate=False))
    found.update(module.named_buffers(remove_duplicate=False))
    return found


def constants_layout(module: torch.nn.Module, names: Sequence[str]) -> dict[str, str]:
    """name → "shape/stride/dtype" for the constants a package reads (what its kernels assume)."""
    live = live_constants(module)
    layout = {}
    for name in names:
        t = live.get(name)
        layout[name] = (
            "absent"
            if t is None
            else f"{list(t.shape)}/{list(t.stride())}/{str(t.dtype).removeprefix('torch.')}/{t.device.type}"
        )
    return layout


# ---- the decision -----------------------------------------------------------------------------------
def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest beside package ``path``; :class:`PackageError` naming the file if it is unusable."""
    file = manifest_path(path)
    if not file.is_file():
        raise PackageError(f"{file} is missing (a package without its manifest cannot be checked)")
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise PackageError(f"{file}: unreadable manifest ({err})") from err
    if not isinstance(manifest, dict) or not isinstance(manifest.get("key"), dict):
        raise PackageError(f"{file}: not a package manifest (no 'key' object)")
    return manifest


def key_differences(built: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """Fields where the package's key differs from the wanted one, as "field: built → wanted"."""
    diffs = []
    for field in sorted(set(built) | set(wanted)):
        old, new = built.get(field), wanted.get(field)
        if old == new:
            continue
        if isinstance(old, dict) and isinstance(new, dict):
            diffs += [f"{field}.{d}" for d in key_differences(old, new)]
        else:
            diffs.append(f"{field}: {_short(old)} → {_short(new)}")
    return diffs


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def check_package(path: Path, wanted: dict[str, Any], module: torch.nn.Module | None = None) -> str | None:
    """None when the package at ``path`` was built for ``wanted`` (and ``module``'s constant layout)
    and its file is intact; otherwise the reason it must not be loaded, for the log and the report."""
    if not path.is_file():
        return f"no package {path.name}"
    try:
        manifest = read_manifest(path)
    except PackageError as err:
        return str(err)
    diffs = key_differences(manifest["key"], wanted)
    if diffs:
        return "stale (" + "; ".join(diffs) + ")"
    if module is not None:
        names = manifest.get("constants", [])
        layout = constants_layout(module, names)
        built = manifest.get("constants_layout", {})
        changed = [n for n in names if built.get(n) != layout[n]]
        if changed or not names:
            first = changed[0] if changed else "(none recorded)"
            return (
                f"stale (module layout: {len(changed)} of {len(names)} constants differ, "
                f"first {first}: {built.get(first)} → {layout.get(first)})"
            )
    size = path.stat().st_size
    if size != manifest.get("size"):
        return f"corrupt: {path.name} has {size} bytes, its manifest says {manifest.get('size')}"
    if _sha256(path) != manifest.get("sha256"):
        return f"corrupt: {path.name}'s SHA-256 differs from its manifest's"
    return None


# ---- build and load ---------------------------------------------------------------------------------
def build_package(
    path: Path,
    module: torch.nn.Module,
    args: tuple[Any, ...],
    key: dict[str, Any],
    weights_files: dict[str, dict[str, Any]] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``torch.export`` ``module`` on ``args``, compile it with AOTInductor into ``path`` (no weights
    inside) and write the manifest (with ``extra`` fields); returns the manifest. The package
    appears only when complete."""
    started = time.perf_counter()
    with torch.no_grad():
        program = torch.export.export(module, args, strict=False)
    exported = time.perf_counter()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp.pt2", dir=path.parent)
    os.close(fd)
    os.chmod(tmp_name, 0o644)  # mkstemp makes it private; a package is as readable as the model
    tmp = Path(tmp_name)
    try:
        cxx, cxx_reason = aoti_toolchain.choose_compiler()
        if cxx is not None:
            log.warning("aoti: C++ compiler %s", cxx_reason)
        with torch._inductor.config.patch({"cpp.cxx": (None, cxx)} if cxx else {}):
            torch._inductor.aoti_compile_and_package(
                program, package_path=str(tmp), inductor_configs=dict(key.get("inductor", inductor_configs()))
            )
        # Opened first in a new process: a package whose native code crashes on load fails the
        # build with the reason, instead of killing this process or, later, a server.
        check_loads(tmp, cxx_reason)
        names = exported_constants(program)
        live = live_constants(module)
        foreign = [n for n in names if n not in live]
        if foreign:  # a constant export made up (not a parameter/buffer): we could not supply it on load
            raise PackageError(
                f"{path.name}: the exported program reads constants the module does not hold: {foreign[:5]}"
            )
        manifest = {
            "key": key,
            "size": tmp.stat().st_size,
            "sha256": _sha256(tmp),
            "constants": names,
            "constants_layout": constants_layout(module, names),
            "weights_files": weights_files or {},
            "cxx": cxx_reason,
            "export_s": round(exported - started, 2),
            "compile_s": round(time.perf_counter() - exported, 2),
            "built": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            **(extra or {}),
        }
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    atomic_write_text(manifest_path(path), json.dumps(manifest, indent=1, sort_keys=True))
    log.info(
        "aoti: built %s (export %.1f s, compile %.1f s, %.1f MiB)",
        path,
        manifest["export_s"],
        manifest["compile_s"],
        manifest["size"] / 2**20,
    )
    return manifest


def check_loads(path: Path, compiler: str, timeout: float = 600) -> None:
    """Open the package at ``path`` in a new Python process; :class:`PackageError` with the exit
    status (the signal's name on a crash), the last lines it printed and ``compiler`` (the build's
    choice, as :func:`aoti_toolchain.choose_compiler` explained it) if that fails."""
    code = "import sys; from pathlib import Path; from rapiddiff.infer.fast_aoti import open_package; "
    code += "print(len(open_package(Path(sys.argv[1])).get_constant_fqns()))"
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as err:
        raise PackageError(f"{path.name}: opening it in a new process took over {timeout:.0f} s") from err
    if proc.returncode == 0:
        return
    status = (
        f"killed by {signal.Signals(-proc.returncode).name}"
        if proc.returncode < 0
        else f"exit {proc.returncode}"
    )
    tail = " | ".join(line.strip() for line in proc.stderr.strip().splitlines()[-4:])
    raise PackageError(
        f"{path.name}: the package was built but does not load in a new process ({status}: {tail[-600:]}); "
        f"C++ compiler: {compiler}. A crash here has come from a compiler that links its own copy of "
        "libstdc++ into the package: set CXX to the system g++ and export again"
    )


def exported_constants(program: Any) -> list[str]:
    """The fully qualified names of the tensors an exported program reads as constants (parameters,
    buffers, lifted tensor constants): what an AOTInductor package built from it asks for on load."""
    sig = program.graph_signature
    names = {
        *sig.inputs_to_parameters.values(),
        *sig.inputs_to_buffers.values(),
        *sig.inputs_to_lifted_tensor_constants.values(),
    }
    return sorted(names)


def open_package(path: Path) -> Any:
    """``torch._inductor.aoti_load_package`` without its device-information probe.

    That probe (``pick_vec_isa``) compiles small C++ programs to find the CPU's vector ISA on every
    load in a process whose Inductor cache is empty — even for a CUDA package — and only logs a
    mismatch (most of a load's time on a small machine). The key check has already compared
    the device fields, so the package is opened with the same loader torch's function constructs.
    """
    try:
        from torch._inductor.package.package import AOTICompiledModel

        # run_single_threaded: the run skips the container's per-call CUDA events and model
        # hand-off, which cannot happen inside a CUDA graph capture (measured: "operation failed due
        # to a previous error during capture" with it off). The fast path calls a package from one
        # thread, and replays the captured loop, never two runs of one package at once.
        loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", True, 1, -1)
    except (ImportError, AttributeError, TypeError):  # another torch version: its own loader
        return torch._inductor.aoti_load_package(str(path), run_single_threaded=True)
    return AOTICompiledModel(loader)


def load_package(path: Path, module: torch.nn.Module, manifest: dict[str, Any]) -> Callable[..., Any]:
    """Load a checked package and point it at ``module``'s live parameters; returns the callable."""
    try:
        compiled = open_package(path)
    except Exception as err:  # the loader raises RuntimeError or worse on a bad archive
        raise PackageError(
            f"{path}: not a loadable AOTInductor package ({type(err).__name__}: {str(err)[:200]}); "
            "delete it, or rebuild with `rapiddiff accelerate export`"
        ) from err
    names = compiled.get_constant_fqns()
    unchecked = sorted(set(names) - set(manifest.get("constants", [])))
    if unchecked:  # a constant whose layout check_package did not compare: never hand it a tensor
        raise PackageError(
            f"{path}: reads constants its manifest does not list ({', '.join(unchecked[:3])}); rebuild it"
        )
    live = live_constants(module)
    # user_managed: the package reads the module's own tensors (no copy); the module keeps them alive.
    compiled.load_constants({n: live[n] for n in names}, check_full_update=True, user_managed=True)
    return compiled


# ---- what the fast path calls ---------------------------------------------------------------------------
class UNetCall(torch.nn.Module):
    """The U-Net as the loop calls it: (x, t, context, cross K/V or {}) → noise prediction."""

    def __init__(self, unet: torch.nn.Module) -> None:
        super().__init__()
        self.unet = unet

    def forward(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor, kv: dict) -> torch.Tensor:
        kwargs = {"cross_attention_kwargs": {"cross_kv": kv}} if kv else {}
        return self.unet(x, t, encoder_hidden_states=context, return_dict=False, **kwargs)[0]


class DecodeCall(torch.nn.Module):
    """``rapiddiff.models.sampling.decode`` as a module: latents → images in [0, 1], float32."""

    def __init__(self, vae: torch.nn.Module) -> None:
        super().__init__()
        self.vae = vae

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        return sampling.decode(self.vae, latents)


class PackageStore:
    """The packages of one model folder: resolve a part for a key → loaded callable, or why not."""

    def __init__(self, folder: Path, weights_root: Path | None, mode: str) -> None:
        if mode not in MODES[1:]:
            raise ValueError(f"aoti mode must be one of {', '.join(MODES)}; got {mode!r}")
        self.folder, self.weights_root, self.mode = Path(folder), weights_root, mode
        # part → the key it wanted and why no package matched (what "auto" builds in the background)
        self.missing: dict[str, tuple[dict[str, Any], str]] = {}

    def weights(self, part: str, path: Path) -> tuple[str, dict[str, dict[str, Any]]]:
        """The weights field of the key (reusing the manifest's per-file hashes when unchanged)."""
        if self.weights_root is None:
            # No folder: the package reads whatever weights the module holds, so the key cannot
            # name a file; it still pins the module's constant layout.
            return "in-memory (no model folder)", {}
        known: dict[str, dict[str, Any]] = {}
        with contextlib.suppress(PackageError):  # no or bad manifest: hash every file
            known = read_manifest(path).get("weights_files", {})
        return weights_fingerprint(self.weights_root, PART_FOLDERS.get(part), known)

    def resolve(
        self,
        part: str,
        module: torch.nn.Module,
        args: tuple[Any, ...],
        fields: dict[str, Any],
        device: torch.device,
        dtype: torch.dtype,
        extra: dict[str, Any] | None = None,
    ) -> tuple[Callable[..., Any] | None, SwitchStatus, dict[str, Any] | None]:
        """(callable or None, report status, manifest or None) for ``part`` on example ``args``.

        ``fields``: {"shapes": ..., "switches": ...}; ``extra``: more manifest fields for a build. A matching, intact package is loaded; else
        ``mode == "build"`` rebuilds it (the reason logged), and ``mode == "load"`` returns None
        with the reason (the caller keeps torch.compile); ``mode == "auto"`` does as "load" and
        keeps the wanted key in :attr:`missing` (:mod:`rapiddiff.infer.fast_background` builds it).
        """
        probe = package_key(part, device=device, dtype=dtype, weights="", **fields)
        path = package_path(self.folder, probe)
        weights, files = self.weights(part, path)
        key = {**probe, "weights": weights}
        reason = check_package(path, key, module)
        self.missing.pop(part, None)
        if reason is None:
            manifest = read_manifest(path)
            started = time.perf_counter()
            try:
                compiled = load_package(path, module, manifest)
            except PackageError as err:
                reason = str(err)
            else:
                took = time.perf_counter() - started
                return compiled, SwitchStatus("on", f"loaded {path.name}", f"{took:.2f} s"), manifest
        if self.mode == "auto":
            self.missing[part] = (key, reason)
            return None, fallback(reason, "torch.compile"), None
        if self.mode == "load":
            why = f"{reason}; build it with `rapiddiff accelerate export`"
            return None, fallback(why, "torch.compile"), None
        log.warning("aoti: building %s: %s", path.name, reason)
        started = time.perf_counter()
        manifest = build_package(path, module, args, key, files, extra)
        compiled = load_package(path, module, manifest)
        took = time.perf_counter() - started
        return compiled, SwitchStatus("on", f"built {path.name} in {took:.0f} s", reason), manifest


__all__ = [
    "FORMAT",
    "MODES",
    "PACKAGE_DIR",
    "DecodeCall",
    "PackageError",
    "PackageStore",
    "UNetCall",
    "build_package",
    "check_loads",
    "check_package",
    "constants_layout",
    "exported_constants",
    "key_differences",
    "load_package",
    "loaded_libstdcxx",
    "package_key",
    "package_path",
    "read_manifest",
    "weights_fingerprint",
]
