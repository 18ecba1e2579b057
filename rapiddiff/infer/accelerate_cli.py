"""``rapiddiff accelerate``: AOTInductor packages of the fast path, kept beside the model.

    rapiddiff accelerate export --model DIR --batch 1 4          # build DIR/accelerated/*.pt2
    rapiddiff accelerate check --model DIR --batch 1             # would they load here? (no building)
    rapiddiff generate --model DIR --fast ...                    # loads them (python: accelerate(pipe, aoti="auto"))

``export`` runs one short generation per batch size through ``accelerate(pipe, aoti="build")``: the
same code that loads the packages builds them, for exactly the shapes and switches the loop uses.
``generate --fast`` and ``serve --fast`` run it by themselves, in the background, where a package
is missing or stale (:mod:`rapiddiff.infer.fast_background`); this command builds them up front.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import fields
from typing import Any

HELP = "AOTInductor packages of the fast path beside a model folder: export, check"


def register(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Build (export) or check the AOTInductor packages of the fast path's U-Net and VAE decoder, "
        "kept in MODEL/accelerated/ and keyed by GPU, torch/CUDA version, dtype, shapes, switches and "
        "the weights files. A new process with accelerate(pipe, aoti='load' or 'auto') loads them "
        "instead of compiling; a stale package is rebuilt (export) or skipped (load) with the reason "
        "logged. `generate --fast` and `serve --fast` start an export in the background where one is "
        "missing (--no-packages: never). "
        "Export builds with a C++ compiler whose code runs in this Python ($CXX if it passes, else "
        "the first of g++, c++, g++-N that does, said in the log) and opens each new package in a "
        "fresh process before keeping it."
    )
    sub = parser.add_subparsers(dest="action", metavar="<action>")
    sub.required = True
    for name, help_text in (
        (
            "export",
            "build the packages for these shapes and switches (each one compiled by Inductor and the host C++ compiler)",
        ),
        ("check", "say whether each package would load here, and why not (builds nothing)"),
    ):
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        cmd.add_argument("--model", required=True, help="model folder (rapiddiff, diffusers SD 1.x, Taiyi)")
        cmd.add_argument(
            "--batch", type=int, nargs="+", default=[1], help="images per call (each its own package)"
        )
        cmd.add_argument("--height", type=int, default=None, help="image height (default: the model's)")
        cmd.add_argument("--width", type=int, default=None, help="image width (default: the model's)")
        cmd.add_argument(
            "--guidance",
            type=float,
            default=None,
            help="guidance scale (default: the model's); > 1 doubles the U-Net batch (classifier-free "
            "guidance), ≤ 1 does not",
        )
        cmd.add_argument(
            "--switches",
            nargs="*",
            default=[],
            metavar="KEY=VALUE",
            help="AccelerateConfig fields, e.g. attention=flash channels_last=false",
        )
        cmd.add_argument(
            "--scheduler",
            default=None,
            help="sampler of the loop (the package key holds its timesteps' dtype; default: the model's)",
        )
        cmd.add_argument(
            "--dir",
            default=None,
            help="package folder (default: MODEL/accelerated where writable, else the user cache)",
        )
        cmd.add_argument("--device", default="auto")
        cmd.set_defaults(func=run)


def parse_switches(items: list[str]) -> dict[str, Any]:
    """["fuse_qkv=false", "attention=flash", "compile_unet=none"] → {"fuse_qkv": False, ...}; errors name the item."""
    from rapiddiff.infer.accelerate import AccelerateConfig  # deferred: torch loads only to run

    known = {f.name for f in fields(AccelerateConfig)} - {"aoti", "aoti_dir"}
    out: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or name not in known:
            raise ValueError(
                f"--switches {item!r}: expected KEY=VALUE with KEY one of {', '.join(sorted(known))}"
            )
        low = text.lower()
        value: Any = {"true": True, "false": False, "none": None, "null": None}.get(low, text)
        if isinstance(value, str) and value.lstrip("-").isdigit():
            value = int(value)
        out[name] = value
    return out


def run(args: argparse.Namespace) -> int:
    from rapiddiff.infer.accelerate import AccelerateConfig, accelerate
    from rapiddiff.infer.pipeline import RapidDiffusionPipeline
    from rapiddiff.utils.device import resolve_device
    from rapiddiff.utils.imports import bytecode_advice, missing_bytecode

    switches = parse_switches(args.switches)
    mode = "build" if args.action == "export" else "load"
    if mode == "load":  # a check compiles nothing: where a package is missing, run the modules eager
        switches = {"compile_unet": None, "compile_vae": None, **switches}
    config = AccelerateConfig(aoti=mode, aoti_dir=args.dir, **switches)
    pipe = RapidDiffusionPipeline.from_pretrained(args.model, device=resolve_device(args.device))
    pipe = accelerate(pipe, config)
    failed = False
    for batch in args.batch:
        pipe.denoiser.clear()  # one captured loop at a time: export needs no memory pools kept
        # Two steps: the packages depend on shapes, not on the number of steps or the scheduler.
        pipe(
            ["export"] * batch,
            num_inference_steps=2,
            guidance_scale=args.guidance,
            height=args.height,
            width=args.width,
            seed=0,
            **({"scheduler": args.scheduler} if args.scheduler else {}),
            output_type="np",
            progress=False,
        )
        row = {"batch": batch, **{k: v for k, v in pipe.report.items() if k.startswith("aoti")}}
        print(json.dumps(row, ensure_ascii=False), flush=True)
        failed |= any(str(v).startswith("fallback") for k, v in row.items() if k != "batch")
    # Packages make compiling free; what a new process then spends is its imports.
    advice = bytecode_advice(missing_bytecode())
    if advice:
        logging.getLogger(__name__).warning("%s", advice)
    if failed and args.action == "export":
        raise RuntimeError("some packages could not be built or loaded; see the reasons above")
    return 1 if failed else 0
