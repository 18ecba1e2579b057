"""Which C++ compiler builds AOTInductor packages that load in this Python.

A package's wrapper ``.so`` is C++ that Inductor compiles with ``$CXX`` (else ``g++``). A compiler
that links its own copy of the C++ runtime into the package makes packages that crash on load (a
``std::regex`` built in the model's constructor), though it reports the same ``libstdc++.so.6`` as
the system ``g++``; so this asks each compiler the question that matters:

* it compiles a small shared library that builds that same ``std::regex``;
* the library must not define the C++ runtime's own locale machinery (a second copy of it beside
  the process's ``libstdc++`` is what crashes), read with ``nm -D`` where binutils are present;
* and a new Python process that has imported torch loads it and runs the regex.

``$CXX`` is kept when it passes; otherwise the first of g++, c++ and g++-N on PATH that passes,
with the reason logged and written into the package's manifest.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# What the package's model constructor does first (torch's aoti_runtime/model.h, parse_device_str).
PROBE_SOURCE = r"""
#include <regex>
#include <string>
extern "C" int rapiddiff_probe(const char* text) {
  std::regex re("(cpu|cuda|xpu|mps)(:([0-9]+))?");
  std::smatch match;
  std::string s(text);
  return std::regex_match(s, match, re) ? 1 : 0;
}
"""
# Defined by libstdc++ itself: a shared library that defines it carries its own copy of the runtime.
RUNTIME_SYMBOL = "_ZNSt6locale7classicEv"
PROBE_RUN = (
    "import ctypes, sys, torch\n"
    "sys.exit(0 if ctypes.CDLL(sys.argv[1]).rapiddiff_probe(b'cuda:0') == 1 else 3)\n"
)


@functools.cache
def check_compiler(cxx: str) -> str | None:
    """None when ``cxx`` builds C++ that runs in a Python process with torch loaded; else why not."""
    with tempfile.TemporaryDirectory(prefix="rapiddiff-cxx-") as tmp:
        source, library = Path(tmp) / "probe.cpp", Path(tmp) / "probe.so"
        source.write_text(PROBE_SOURCE)
        try:
            built = subprocess.run(
                [cxx, "-shared", "-fPIC", "-O1", "-std=c++17", str(source), "-o", str(library)],
                capture_output=True,
                text=True,
                timeout=180,
            )
        except (OSError, subprocess.SubprocessError) as err:
            return f"does not run ({err})"
        if built.returncode != 0:
            return f"does not compile C++ ({built.stderr.strip()[-200:]})"
        if _defines(library, RUNTIME_SYMBOL):
            return "links a copy of the C++ runtime into what it builds (static libstdc++)"
        try:
            ran = subprocess.run(
                [sys.executable, "-c", PROBE_RUN, str(library)], capture_output=True, text=True, timeout=300
            )
        except subprocess.SubprocessError as err:
            return f"its code did not finish in a torch process ({err})"
        if ran.returncode != 0:
            how = f"signal {-ran.returncode}" if ran.returncode < 0 else f"exit {ran.returncode}"
            return f"its code fails in a torch process ({how})"
    return None


def _defines(library: Path, symbol: str) -> bool:
    """Whether ``library`` exports ``symbol`` (False where nm is missing: the run test still decides)."""
    nm = shutil.which("nm")
    if nm is None:
        return False
    try:
        out = subprocess.run(
            [nm, "-D", "--defined-only", str(library)], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return any(line.split()[-1] == symbol for line in out.splitlines() if line.strip())


def candidates() -> list[str]:
    """``$CXX`` (Inductor's choice), then g++, c++ and every g++-N on PATH, each binary once."""
    names = [os.environ.get("CXX") or "g++", "g++", "c++"]
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        if os.path.isdir(folder):
            names += sorted(p.name for p in Path(folder).glob("g++-[0-9]*"))
    seen, found = set(), []
    for name in names:
        where = shutil.which(name)
        if where and os.path.realpath(where) not in seen:
            seen.add(os.path.realpath(where))
            found.append(name)
    return found


def choose_compiler() -> tuple[str | None, str]:
    """(the compiler to build packages with, or None to keep Inductor's own; why), for the log and
    the manifest."""
    default = os.environ.get("CXX") or "g++"
    rejected = []
    for cxx in candidates():
        problem = check_compiler(cxx)
        if problem is None:
            if cxx == default:
                return None, f"{default} (its C++ runs in this process)"
            return cxx, f"{cxx}, not $CXX: " + "; ".join(rejected)
        rejected.append(f"{cxx} {problem}")
    return None, f"{default}, though no compiler passed: " + "; ".join(rejected or ["none found on PATH"])


__all__ = ["candidates", "check_compiler", "choose_compiler"]
