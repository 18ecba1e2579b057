"""Import one module of a large library without running the ``__init__`` of every package on its way.

diffusers' ``models/unets/__init__.py`` imports all twelve U-Nets, ``models/transformers/__init__.py``
about eighty transformer models, ``hooks/__init__.py`` every hook; transformers' ``models/__init__.py``
scans ~400 model folders to build its lazy table. Importing ``UNet2DConditionModel`` from its own
file still runs those ``__init__`` files first (Python imports every parent package): ~150 modules,
about half a second of a cold ``rapiddiff generate`` on a small CPU, for classes it never uses.

:func:`import_module` imports the named module with the listed packages *deferred*: each is put in
``sys.modules`` as the package's real module object (its own spec, ``__path__`` and file) whose
``__init__`` has not run yet. Submodules import through ``__path__`` as usual; the first time
anything asks the package for a name it does not have (``from diffusers.models.unets import
UNet1DModel``, ``diffusers.models.transformers.X``), its ``__init__`` runs in place and the name is
looked up again — so the rest of the process sees the package exactly as a plain import gives it.
That is :class:`importlib.util.LazyLoader`'s idea, which cannot serve here: a LazyLoader module
runs its ``__init__`` as soon as ``__path__`` is read, i.e. on the first submodule import.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Iterable
from types import ModuleType
from typing import Any


def _defer_package(name: str) -> None:
    """Register package ``name`` (its parent imported) in sys.modules with its ``__init__`` not run."""
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or spec.submodule_search_locations is None or spec.loader is None:
        return  # not a package here (another version of the library): a plain import does the job
    module = importlib.util.module_from_spec(spec)

    def __getattr__(attr: str) -> Any:  # the PEP 562 hook
        # First missing name: run the package's own __init__ in this module, then look again.
        # (diffusers/transformers __init__s may put a _LazyModule in sys.modules instead of
        # filling this one: then that object answers, here and as the parent's attribute.)
        del module.__dict__["__getattr__"]
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        real = sys.modules.get(name, module)
        if real is not module:
            parent, _, child = name.rpartition(".")
            if parent:
                setattr(sys.modules[parent], child, real)
            module.__dict__["__getattr__"] = lambda a: getattr(real, a)
        return getattr(real, attr)

    module.__dict__["__getattr__"] = __getattr__
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:  # a top-level package has no parent to name it
        setattr(sys.modules[parent], child, module)


def import_module(name: str, defer: Iterable[str] = ()) -> ModuleType:
    """``importlib.import_module(name)`` with the packages in ``defer`` (parents first) deferred.

    A package already imported is left as it is; so is one that does not exist in the installed
    version of the library (the plain import then runs, only slower).
    """
    if name in sys.modules:
        return sys.modules[name]
    for package in defer:
        parent = package.rpartition(".")[0]
        if parent:
            importlib.import_module(parent)
        _defer_package(package)
    return importlib.import_module(name)


# The libraries a generating process imports; their bytecode decides a third of its start.
HEAVY_IMPORTS = ("torch", "diffusers", "transformers")


def missing_bytecode(names: Iterable[str] = HEAVY_IMPORTS) -> list[str]:
    """The installed packages among ``names`` without compiled bytecode beside their ``__init__``
    (where this Python looks: ``__pycache__`` or ``sys.pycache_prefix``) — a proxy for the whole
    package, which one check per package keeps instant.

    A container that sets ``PYTHONDONTWRITEBYTECODE=1`` over a ``pip install --no-compile`` (or an
    image that ships torch without ``__pycache__``) compiles every imported module from source in
    every new process, which can double a package process's start. ``python -m compileall``
    fixes it once."""
    missing = []
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue  # not installed, or not a source package
        if not os.path.exists(importlib.util.cache_from_source(spec.origin)):
            missing.append(name)
    return missing


def bytecode_advice(missing: Iterable[str]) -> str | None:
    """One line saying how to compile the bytecode ``missing`` names, or None when nothing is missing."""
    names = list(missing)
    if not names:
        return None
    folders = sorted({os.path.dirname(os.path.dirname(importlib.util.find_spec(n).origin)) for n in names})
    return (
        f"no compiled bytecode for {', '.join(names)}: every new process compiles their modules from "
        f"source (PYTHONDONTWRITEBYTECODE={os.environ.get('PYTHONDONTWRITEBYTECODE', 'unset')}; about "
        f"twice the start of a package process). Compile it once: python -m compileall -q -j 0 "
        + " ".join(folders)
    )
