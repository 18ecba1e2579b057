"""``rapiddiff bench``: time stock diffusers, the torch.compile recipe and rapiddiff's fast path in one process."""

from __future__ import annotations

import argparse

HELP = "benchmark stock diffusers vs the torch.compile recipe vs rapiddiff's fast path (one process)"


def register(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Time stock diffusers (eager), the strongest stock recipe (channels_last + fused QKV + "
        "torch.compile reduce-overhead, as huggingface/diffusion-fast) and rapiddiff's accelerate() "
        "side by side on the same weights and seed: it/s, images/s, end-to-end seconds, peak memory, "
        "warm-up, and parity with eager (latent relative error, image PSNR). Random SD 1.5 weights "
        "unless --model is given. Writes OUT/bench.json, OUT/bench.md and OUT/first_images.png."
    )
    parser.add_argument(
        "--model", default=None, help="model folder (diffusers SD 1.x layout); default: random weights"
    )
    parser.add_argument(
        "--preset", default="sd15", help="architecture for random weights: sd15, kshapes, tiny"
    )
    parser.add_argument("--steps", type=int, help="denoising steps (PNDM; default: the bench protocol's)")
    parser.add_argument("--guidance", type=float, help="guidance scale (default: the bench protocol's)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="batch sizes to time")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["eager", "recipe", "rapiddiff"],
        help="eager, recipe, rapiddiff, rapiddiff-tome, or rapiddiff+KEY=VALUE[,KEY=VALUE] (the "
        "defaults with accelerate switches changed, e.g. rapiddiff+attention=flash,compile_regions); "
        "eager always runs: it is the parity reference",
    )
    parser.add_argument(
        "--token-merge",
        type=float,
        default=0.5,
        metavar="R",
        help="ToMe ratio of the rapiddiff-tome variant (approximate: its PSNR against rapiddiff is in its note)",
    )
    parser.add_argument(
        "--switches",
        nargs="*",
        default=[],
        help="switch-by-switch parity runs at the first batch size ('all')",
    )
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-run-time", type=float, default=2.0, help="seconds of timed runs per row")
    parser.add_argument(
        "--second-process", action="store_true", help="time a new process that loads the compile cache"
    )
    parser.add_argument(
        "--no-compile", action="store_true", help="no torch.compile in rapiddiff (CPU smoke runs)"
    )
    parser.add_argument(
        "--profile",
        nargs="*",
        default=None,
        metavar="VARIANT",
        help="profile one image of each fast-path VARIANT (default: rapiddiff) without the loop graph: "
        "GPU time by kernel family and the top kernels in OUT/profile.txt, every kernel in OUT/profile.csv",
    )
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=0.0,
        help="start no task after this many seconds (each skipped one is named in the output)",
    )
    parser.add_argument(
        "--stacks-after-s",
        type=float,
        default=300.0,
        help="print every thread's stack to stderr when one task has run this long, so a hang shows "
        "where it is (0: never)",
    )
    parser.add_argument("--out", default="bench-out", help="output folder")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rapiddiff.infer.bench import BenchConfig, run_bench  # deferred: torch loads only to run

    protocol = {"steps": args.steps, "guidance": args.guidance}  # None: the bench's protocol values
    cfg = BenchConfig(
        model=args.model,
        preset=args.preset,
        **{k: v for k, v in protocol.items() if v is not None},
        batches=tuple(args.batch),
        variants=tuple(args.variants),
        switches=tuple(args.switches),
        dtype=args.dtype,
        seed=args.seed,
        min_run_time=args.min_run_time,
        second_process=args.second_process,
        compile=not args.no_compile,
        profile=args.profile is not None,
        profile_variants=tuple(args.profile or ("rapiddiff",)),
        device=args.device,
        budget_s=args.budget_s,
        stacks_after_s=args.stacks_after_s,
        out=args.out,
        token_merge=args.token_merge,
    )
    run_bench(cfg)
    return 0


def main(argv: list[str] | None = None) -> int:
    from rapiddiff.utils.logging import setup_logging

    parser = argparse.ArgumentParser(prog="rapiddiff bench", description=HELP)
    register(parser)
    args = parser.parse_args(argv)
    setup_logging(0)
    return args.func(args)
