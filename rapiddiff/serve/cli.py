"""``rapiddiff serve``: the HTTP API and web page (uvicorn), or the same app on Ray Serve (``--ray``).

Heavy imports (torch, fastapi, uvicorn, ray) happen inside :func:`run`.
"""

from __future__ import annotations

import argparse

from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)

EPILOG = """examples:
  rapiddiff serve                                   # the default built-in model on http://127.0.0.1:7860
  rapiddiff serve --model builtin:kshapes           # a built-in model by name (rapiddiff generate --list-models)
  rapiddiff serve --model runs/kshapes-model --fast --devices 0,1 --max-batch 8
  rapiddiff serve --ray --replicas-per-gpu 1 --max-replicas 8   # on a Ray cluster (ray start ... first)

  curl http://127.0.0.1:7860/v1/images/generations -H 'Content-Type: application/json' \\
       -d '{"prompt": "浅蓝色背景上有一个番茄", "n": 1, "seed": 7, "response_format": "b64_json"}'

Open http://127.0.0.1:7860/ for the web page; /docs lists the API; /metrics is Prometheus text.
"""


def _warmup_size(text: str) -> tuple[int, int]:
    """``--warmup-size WIDTHxHEIGHT`` (the API's form) → the (height, width) the config keeps."""
    from rapiddiff.serve.config import parse_size

    try:
        width, height = parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err
    return height, width


def register(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument(
        "--model",
        metavar="DIR|builtin:NAME",
        help="model folder, or builtin:NAME for a built-in model (default: the default built-in model)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=7860, help="port (default 7860)")
    parser.add_argument(
        "--devices",
        default="auto",
        help="one model copy per device: auto, cpu, 0,1 (CUDA indices) or cuda:0,cuda:1 (default auto)",
    )
    parser.add_argument(
        "--dtype", default="auto", help="auto (fp16 on CUDA, fp32 on CPU), float32, float16 or bfloat16"
    )
    parser.add_argument(
        "--fast", action="store_true", help="the accelerated inference path (warmed up before /ready)"
    )
    parser.add_argument(
        "--no-packages", action="store_true",
        help="with --fast: no AOTInductor packages (by default the server starts from the ones built for "
        "this model, GPU, torch and switches, and where they are missing builds them once in the background "
        "for the next start, serving with torch.compile meanwhile)",
    )  # fmt: skip
    parser.add_argument(
        "--warmup-size", type=_warmup_size, action="append", metavar="WxH|N",
        help="with --fast: a size to warm up before /ready, WIDTHxHEIGHT as the API's size "
        "(repeatable; default: the model's size)",
    )  # fmt: skip
    parser.add_argument("--max-batch", type=int, default=4, help="most images per pipeline call (default 4)")
    parser.add_argument(
        "--fast-batches", metavar="N,N,...",
        help="with --fast: batch sizes given a captured graph, ending at --max-batch (default 1,2,4,...; "
        "each costs a compile before /ready); a partial batch is padded or split, whichever warm-up timed quicker",
    )  # fmt: skip
    parser.add_argument(
        "--max-wait-ms",
        type=float,
        default=50.0,
        help="how long a request may wait for its batch to fill, only while others could still join "
        "(default 50; a lone request never waits)",
    )
    parser.add_argument(
        "--max-queue", type=int, default=256, help="most images queued before 429 (default 256)"
    )
    parser.add_argument("--max-images", type=int, default=4, help="most images per request, n (default 4)")
    parser.add_argument(
        "--max-steps", type=int, default=100, help="most denoising steps per request (default 100)"
    )
    parser.add_argument(
        "--max-side", type=int, default=1024, help="largest side before upscaling (default 1024)"
    )
    parser.add_argument(
        "--lora",
        action="append",
        metavar="DIR[:SCALE]",
        help="merge a LoRA (a `train finetune` LoRA folder or a diffusers LoRA file) into the served model; repeatable",
    )
    parser.add_argument(
        "--controlnet",
        action="append",
        metavar="PATH",
        help="load a ControlNet (a diffusers folder or .safetensors) into the served model, so requests may "
        "send control_image; repeatable, one control image per net in a request, in this order",
    )
    parser.add_argument("--steps", type=int, help="steps when a request names none (default: the model's)")
    from rapiddiff.models.sampling import PRESETS, presets_help

    parser.add_argument(
        "--preset", choices=sorted(PRESETS),
        help=f"sampler and steps when a request names none, in place of the model's ({presets_help()}); "
        "--steps beside it wins",
    )  # fmt: skip
    parser.add_argument(
        "--upscale", action=argparse.BooleanOptionalAction, default=None,
        help="upscale when a request does not say (default: on when the model has an upscaler, as generate)",
    )  # fmt: skip
    ray = parser.add_argument_group("Ray Serve (pip install 'rapiddiff[ray]')")
    ray.add_argument("--ray", action="store_true", help="deploy on Ray Serve instead of one uvicorn process")
    ray.add_argument(
        "--ray-address", default=None, help="Ray cluster address (default: auto, else a local Ray)"
    )
    ray.add_argument("--replicas-per-gpu", type=int, default=1, help="replicas sharing one GPU (default 1)")
    ray.add_argument("--min-replicas", type=int, default=1, help="autoscaling: fewest replicas (default 1)")
    ray.add_argument("--max-replicas", type=int, default=1, help="autoscaling: most replicas (default 1)")
    ray.add_argument(
        "--target-ongoing-requests", type=float, default=8,
        help="autoscaling: requests per replica Ray Serve aims at (default 8, about two full batches)",
    )  # fmt: skip
    parser.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> object:
    from rapiddiff.infer.generate_cli import parse_lora
    from rapiddiff.serve.config import ServeConfig, parse_devices

    return ServeConfig(
        model=args.model,
        devices=parse_devices(args.devices),
        dtype=args.dtype,
        fast=args.fast,
        packages=not args.no_packages,
        warmup_sizes=list(args.warmup_size or []),
        max_batch=args.max_batch,
        fast_batches=_int_list(args.fast_batches, "--fast-batches"),
        max_wait_ms=args.max_wait_ms,
        max_queue=args.max_queue,
        max_images=args.max_images,
        max_steps=args.max_steps,
        max_side=args.max_side,
        default_steps=args.steps,
        preset=args.preset,
        default_upscale=args.upscale,
        loras=[parse_lora(item) for item in args.lora or []],
        controlnets=list(args.controlnet or []),
    )


def _int_list(text: str | None, flag: str) -> list[int]:
    if not text:
        return []
    try:
        return [int(part) for part in text.split(",")]
    except ValueError as err:
        raise ValueError(f"{flag} '{text}': give comma-separated integers, e.g. 1,2,4,8") from err


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    if args.ray:
        from rapiddiff.serve.ray_app import run_ray

        return run_ray(
            config,  # type: ignore[arg-type]
            host=args.host,
            port=args.port,
            address=args.ray_address,
            replicas_per_gpu=args.replicas_per_gpu,
            min_replicas=args.min_replicas,
            max_replicas=args.max_replicas,
            target_ongoing_requests=args.target_ongoing_requests,
        )
    import uvicorn

    from rapiddiff.serve.app import create_app

    app = create_app(config)  # type: ignore[arg-type]
    print(
        f"rapiddiff serve: http://{args.host}:{args.port}/ (API: /v1/images/generations, /docs)", flush=True
    )
    # uvicorn's graceful shutdown (SIGINT/SIGTERM) waits for in-flight requests; the app's lifespan
    # then finishes whatever is still queued before the process exits.
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=None)
    return 0
