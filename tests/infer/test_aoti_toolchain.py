"""Which C++ compiler builds AOTInductor packages that load (rapiddiff.infer.aoti_toolchain): on the
H100 image CXX=/opt/gcc/bin/g++ built packages that crashed on load, the system g++ working ones."""

from __future__ import annotations

import os
import shutil
import stat

import pytest
import torch

from rapiddiff.infer import aoti_toolchain, fast_aoti

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ on PATH")


def _wrapper(tmp_path, name, extra):
    """A compiler that is g++ with ``extra`` flags (what a site's own g++ wrapper may add)."""
    path = tmp_path / name
    path.write_text(f'#!/bin/sh\nexec g++ "$@" {extra}\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@needs_gxx
def test_the_system_compiler_passes():
    aoti_toolchain.check_compiler.cache_clear()
    assert aoti_toolchain.check_compiler("g++") is None


@needs_gxx
def test_a_compiler_that_links_its_own_copy_of_the_runtime_is_rejected(tmp_path):
    static = _wrapper(tmp_path, "static-g++", "-static-libstdc++")
    aoti_toolchain.check_compiler.cache_clear()
    problem = aoti_toolchain.check_compiler(static)
    assert problem == "links a copy of the C++ runtime into what it builds (static libstdc++)"


@needs_gxx
def test_its_regex_crashes_a_torch_process_which_the_run_check_catches_without_nm(tmp_path, monkeypatch):
    """The failure itself, reproduced here: a std::regex built against a private copy of libstdc++
    aborts (std::bad_cast; SIGSEGV on the H100 image) in a process that loaded torch's libstdc++."""
    static = _wrapper(tmp_path, "static-g++", "-static-libstdc++")
    monkeypatch.setattr(aoti_toolchain, "_defines", lambda library, symbol: False)  # as without binutils
    aoti_toolchain.check_compiler.cache_clear()
    assert aoti_toolchain.check_compiler(static).startswith("its code fails in a torch process (signal ")
    aoti_toolchain.check_compiler.cache_clear()


def test_a_compiler_that_fails_is_rejected_with_its_error(tmp_path):
    broken = tmp_path / "broken-g++"
    broken.write_text("#!/bin/sh\necho 'fatal error: array: No such file or directory' >&2\nexit 1\n")
    broken.chmod(0o755)
    aoti_toolchain.check_compiler.cache_clear()
    assert "does not compile C++ (fatal error: array" in aoti_toolchain.check_compiler(str(broken))
    assert aoti_toolchain.check_compiler(str(tmp_path / "missing")).startswith("does not run")


@needs_gxx
def test_cxx_is_replaced_by_the_first_compiler_that_passes_and_the_reason_names_both(tmp_path, monkeypatch):
    static = _wrapper(tmp_path, "static-g++", "-static-libstdc++")
    monkeypatch.setenv("CXX", static)
    aoti_toolchain.check_compiler.cache_clear()
    found = aoti_toolchain.candidates()
    assert found[0] == static and "g++" in found
    cxx, why = aoti_toolchain.choose_compiler()
    assert cxx == "g++"
    assert why.startswith(f"g++, not $CXX: {static} links a copy of the C++ runtime")


def test_cxx_that_passes_is_kept_and_nothing_passing_keeps_inductors_choice(monkeypatch):
    monkeypatch.setenv("CXX", "/opt/gcc/bin/g++")
    monkeypatch.setattr(aoti_toolchain, "candidates", lambda: ["/opt/gcc/bin/g++", "g++"])
    monkeypatch.setattr(aoti_toolchain, "check_compiler", lambda cxx: None)
    assert aoti_toolchain.choose_compiler() == (None, "/opt/gcc/bin/g++ (its C++ runs in this process)")
    monkeypatch.setattr(
        aoti_toolchain, "check_compiler", lambda cxx: "its code fails in a torch process (signal 11)"
    )
    cxx, why = aoti_toolchain.choose_compiler()
    assert cxx is None and why.startswith(
        "/opt/gcc/bin/g++, though no compiler passed: /opt/gcc/bin/g++ its code"
    )


def test_this_process_runtime_enters_the_package_key():
    runtime = fast_aoti.loaded_libstdcxx()  # torch is imported: it links libstdc++
    assert runtime is not None and "libstdc++.so" in runtime and os.path.isfile(runtime)
    assert fast_aoti.device_fields(torch.device("cpu"))["libstdcxx"] == os.path.basename(runtime)
