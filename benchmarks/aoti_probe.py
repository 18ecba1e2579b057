"""Why AOTInductor packages crash on load on the device machine, and which toolchain loads them.

On torch 2.11 + an H100 every package (a toy's too, with or without weights inside, loaded in the
building process or a new one) died with SIGSEGV in ``AOTIModelPackageLoader``: cuda-gdb puts it in
the package's own wrapper ``.so``, compiling ``std::regex`` in ``parse_device_str`` (the model's
constructor), inside ``regex_traits::transform_primary`` — the C++ runtime's locale code. That points
at the C++ compiler Inductor builds the wrapper with versus the libstdc++ the process has loaded.

This prints the toolchain facts (each C++ compiler on PATH, the libstdc++ it links, the one a
torch process maps), builds a small model's package with each compiler (``CXX``), and loads each in
a fresh process — plainly, and on a crash again with the compiler's own libstdc++ preloaded. Each
row: build and load return codes, the faulthandler's frame on a crash, the wrapper's NEEDED
libraries, and the output's largest difference from eager. Results: ``OUT/aoti_probe.json``.

    python benchmarks/aoti_probe.py --out $OUT [--cxx g++ clang++]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def model_and_input(device: str) -> tuple[Any, Any]:
    import torch
    from torch import nn

    torch.manual_seed(0)

    class Block(nn.Module):
        """Conv → GroupNorm → SiLU → conv, then a linear over channels: the U-Net's op mix."""

        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(64, 128, 3, padding=1)
            self.norm = nn.GroupNorm(32, 128)
            self.conv2 = nn.Conv2d(128, 64, 3, padding=1)
            self.proj = nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.conv2(nn.functional.silu(self.norm(self.conv1(x))))
            return self.proj((x + h).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)

    module = Block().to(device=device, dtype=torch.float16).eval()
    x = torch.randn(2, 64, 32, 32, device=device, dtype=torch.float16)
    return module, x


def build(path: Path, in_so: bool, device: str) -> dict[str, Any]:
    import torch

    module, x = model_and_input(device)
    started = time.perf_counter()
    with torch.no_grad():
        program = torch.export.export(module, (x,), strict=False)
    torch._inductor.aoti_compile_and_package(
        program,
        package_path=str(path),
        inductor_configs={"aot_inductor.package_constants_in_so": in_so},
    )
    return {"built_s": round(time.perf_counter() - started, 1), "size": path.stat().st_size}


def load_and_run(path: Path, in_so: bool, device: str) -> dict[str, Any]:
    import torch

    from rapiddiff.infer import fast_aoti

    module, x = model_and_input(device)
    started = time.perf_counter()
    compiled = fast_aoti.open_package(path)
    opened = time.perf_counter() - started
    names = compiled.get_constant_fqns()
    live = fast_aoti.live_constants(module)
    if not in_so:  # no weights inside: the module's own, as fast_aoti.load_package does
        compiled.load_constants({n: live[n] for n in names}, check_full_update=True, user_managed=True)
    with torch.no_grad():
        got = compiled(x)
        got = got[0] if isinstance(got, (list, tuple)) else got
        want = module(x)
    torch.cuda.synchronize() if device == "cuda" else None
    return {
        "opened_s": round(opened, 2),
        "constants": len(names),
        "max_abs_diff": float((got.float() - want.float()).abs().max()),
    }


def child(args: argparse.Namespace) -> None:
    spec = json.loads(args.child)
    path, in_so, device = Path(spec["path"]), spec["in_so"], spec["device"]
    row: dict[str, Any] = {}
    if spec["build"]:
        row.update(build(path, in_so, device))
        print(json.dumps({"stage": "built", **row}), flush=True)
    if spec["load"]:
        row.update(load_and_run(path, in_so, device))
    print(json.dumps(row), flush=True)


def run(spec: dict[str, Any], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    env = {**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})}
    started = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(spec)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"rc": "timeout", "wall_s": round(time.perf_counter() - started, 1)}
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    out: dict[str, Any] = {"rc": proc.returncode, "wall_s": round(time.perf_counter() - started, 1)}
    for row in rows:
        out.update(row)
    if proc.returncode != 0:
        out["stderr_tail"] = proc.stderr[-1500:]
    return out


def toolchain(cxx: str) -> dict[str, Any]:
    """The compiler's version and the libstdc++ it links against ("none": CXX unset, Inductor's pick)."""
    facts: dict[str, Any] = {"cxx": cxx}
    if cxx == "none":
        return facts
    from rapiddiff.infer import aoti_toolchain

    # rapiddiff's own verdict (what an export would decide), beside the raw facts
    facts["rapiddiff_check"] = aoti_toolchain.check_compiler(cxx) or "passes"
    try:
        facts["version"] = subprocess.check_output([cxx, "--version"], text=True).splitlines()[0]
        lib = subprocess.check_output([cxx, "-print-file-name=libstdc++.so.6"], text=True).strip()
        facts["libstdcxx"] = os.path.realpath(lib) if os.path.isabs(lib) else lib
    except (OSError, subprocess.SubprocessError) as err:
        facts["error"] = str(err)
    return facts


def wrapper_facts(package: Path) -> dict[str, Any]:
    """NEEDED libraries of the package's wrapper .so, and whether it carries its own copy of
    libstdc++ (what set the H100 image's crashing packages apart)."""
    import zipfile

    from rapiddiff.infer import aoti_toolchain

    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(package) as zf:
        names = [n for n in zf.namelist() if n.endswith(".so")]
        if not names:
            return {"error": "no .so in the package"}
        so = Path(zf.extract(names[0], tmp))
        facts: dict[str, Any] = {
            "carries_libstdcxx_copy": aoti_toolchain._defines(so, aoti_toolchain.RUNTIME_SYMBOL)
        }
        try:
            text = subprocess.check_output(["readelf", "-d", str(so)], text=True, stderr=subprocess.STDOUT)
        except (OSError, subprocess.SubprocessError) as err:
            facts["readelf"] = str(err)
        else:
            facts["needed"] = [
                line.split("[")[-1].rstrip("]") for line in text.splitlines() if "NEEDED" in line
            ]
    return facts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "aoti-probe-out"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--timeout-s", type=float, default=240)
    p.add_argument(
        "--cxx",
        nargs="*",
        default=None,
        help="C++ compilers to build with; none: CXX unset (default: all found)",
    )
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="aoti-probe-"))
    try:
        # importing fast_aoti imports torch, which maps libstdc++ here as in any process that loads a package
        from rapiddiff.infer import aoti_toolchain
        from rapiddiff.infer.fast_aoti import loaded_libstdcxx

        result: dict[str, Any] = {"process_libstdcxx": [loaded_libstdcxx()], "builds": []}

        cxxs = args.cxx or aoti_toolchain.candidates()
        result["toolchains"] = [toolchain(c) for c in cxxs]
        print(json.dumps(result)[:3000], flush=True)
        # Build with every compiler at once (separate caches), without loading: a load crashes the builder.
        procs = {}
        for facts in result["toolchains"]:
            if "error" in facts:
                continue
            cxx = facts["cxx"]
            path = scratch / f"toy-{cxx.replace('+', 'x')}.pt2"
            env = {**os.environ, "CXX": cxx, "TORCHINDUCTOR_CACHE_DIR": str(scratch / f"cache-{cxx}")}
            if cxx == "none":
                del env["CXX"]
            spec = {"path": str(path), "in_so": False, "device": args.device, "build": True, "load": False}
            procs[cxx] = (
                path,
                subprocess.Popen(
                    [sys.executable, __file__, "--child", json.dumps(spec)],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                ),
            )
        for facts in result["toolchains"]:
            cxx = facts["cxx"]
            if cxx not in procs:
                continue
            path, proc = procs[cxx]
            try:
                _, err = proc.communicate(timeout=args.timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                result["builds"].append({"cxx": cxx, "build": "timeout"})
                continue
            row: dict[str, Any] = {"cxx": cxx, "build_rc": proc.returncode}
            if proc.returncode != 0 or not path.is_file():
                row["build_error"] = err[-1500:]
                result["builds"].append(row)
                continue
            row["size"] = path.stat().st_size
            row["wrapper"] = wrapper_facts(path)
            spec = {"path": str(path), "in_so": False, "device": args.device, "build": False, "load": True}
            row["load"] = run(spec, args.timeout_s)
            lib = facts.get("libstdcxx", "")
            if row["load"].get("rc") != 0 and os.path.isabs(lib):
                row["load_with_compilers_libstdcxx"] = run(spec, args.timeout_s, {"LD_PRELOAD": lib})
            result["builds"].append(row)
            print(json.dumps(row)[:2500], flush=True)
            (out / "aoti_probe.json").write_text(json.dumps(result, indent=1))
        (out / "aoti_probe.json").write_text(json.dumps(result, indent=1))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # the toy packages and their caches
    return 0


if __name__ == "__main__":
    sys.exit(main())
