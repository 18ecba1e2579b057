"""``rapiddiff generate``: text → PNG files (with their settings inside) and a grid.

Heavy imports (torch, diffusers) happen inside :func:`run`, so registering the command is instant.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import re
import tempfile
from pathlib import Path
from typing import Any

from rapiddiff.models.sampling import PRESETS, SamplingDefaults, preset, presets_help, scheduler_choices
from rapiddiff.utils.io import atomic_open, read_text_lines
from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)
_LIBRARY = SamplingDefaults()  # the fallback when a model folder names no sampling defaults

EPILOG = """examples:
  rapiddiff generate "浅蓝色背景上有一个番茄"
  rapiddiff generate "一只熊猫" --model builtin:kshapes --num-images 4 --seed 7 --out out/
  rapiddiff generate "一只熊猫" --model runs/my-model    # a model folder of your own
  rapiddiff generate --list-models                       # the built-in models, by name
  rapiddiff generate --prompts prompts.txt --scheduler dpm++ --steps 25 --no-upscale
  rapiddiff generate --from-png out/00001-7.png          # the same image again
  rapiddiff generate "红色的番茄" --init-image photo.png --strength 0.6           # img2img
  rapiddiff generate "一个香蕉" --init-image photo.png --mask mask.png            # inpainting (white = repaint)
  rapiddiff generate "一只熊猫" --lora runs/finetune/lora/model:0.8              # a LoRA at 0.8
  rapiddiff generate "一只熊猫" --preset fast                 # a measured sampler + steps (see --preset)
  rapiddiff generate "一只熊猫" --preset fast --steps 25      # a flag beside a preset wins
  rapiddiff generate "一只熊猫" --deep-cache 3                # faster, approximate (DeepCache)
  rapiddiff generate "一只熊猫" --token-merge 0.5             # approximate token merging (ToMe)
  rapiddiff generate "一只熊猫" --controlnet nets/canny --control-image edges.png --control-scale 0.8
  rapiddiff generate "一只熊猫" --controlnet nets/canny --control-image edges.png \
                              --controlnet nets/depth --control-image depth.png --control-end 0.5 1.0

ControlNet: the k-th --control-image goes with the k-th --controlnet (a diffusers ControlNet folder
or a .safetensors file; safetensors only). Without --controlnet, the model folder's controlnet/ is
used with the one --control-image. --control-scale, --control-start and --control-end take one value
for every net or one value per net, in the same order (as diffusers' controlnet_conditioning_scale,
control_guidance_start and control_guidance_end).

Every PNG holds its prompt, negative prompt, seed, steps, guidance, scheduler, size, model,
upscaler file, LoRAs, init image / mask and control images (path + sha256, with each ControlNet
and its scale and window) in text chunks; --from-png reads them back (flags given on the command
line override them) and refuses an init or control image that is missing or changed.
Without --model (or with --model builtin) the default built-in model is used ($RAPIDDIFF_MODEL
replaces it); --model builtin:NAME picks a built-in model by name. A PNG made by a built-in model
records it as builtin:NAME, so --from-png remakes it with that model whatever the default is.
"""


def default_model_dir() -> Path:
    """The model used without --model: $RAPIDDIFF_MODEL, else the default built-in model."""
    from rapiddiff.models.builtin import builtin_model_dir

    return builtin_model_dir()


def default_knowledge_mode() -> str | None:
    """The knowledge mode the default model was saved with (None where it says none), for --help."""
    import json

    settings = default_model_dir() / "text_encoder" / "rapiddiff_encoder.json"
    try:
        mode = json.loads(settings.read_text("utf-8")).get("knowledge_mode")
    except (OSError, ValueError, AttributeError):
        return None
    return mode if isinstance(mode, str) else None


def resolve_model_dir(model: str | None) -> Path:
    """--model as given (a folder, ``builtin``, ``builtin:NAME`` or None) → the model folder."""
    from rapiddiff.models.builtin import is_builtin_spec, resolve_model

    if model and not is_builtin_spec(model):
        return Path(model)
    path = resolve_model(model)
    if not (path / "model_index.json").is_file():
        raise FileNotFoundError(
            f"no built-in model in this installation ({path} is missing; the built-in models ship "
            "in released packages). Pass --model DIR: a rapiddiff model folder, a diffusers Stable "
            "Diffusion 1.x folder or a Taiyi-style folder"
        )
    return path


def parse_size(text: str) -> tuple[int, int]:
    """ "WxH" (width first, as the OpenAI images API's "WIDTHxHEIGHT") or "N" (square) → (height, width)."""
    match = re.fullmatch(r"\s*(\d+)\s*(?:[xX×*]\s*(\d+))?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(
            f"size '{text}': use WIDTHxHEIGHT (e.g. 192x128: 192 wide, 128 high) or N for N×N"
        )
    width = int(match.group(1))
    height = int(match.group(2)) if match.group(2) else width
    if height <= 0 or width <= 0:
        raise argparse.ArgumentTypeError(f"size '{text}': sides must be positive")
    return height, width


def register(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument("prompt", nargs="?", help="the prompt (Chinese or any language the model knows)")
    parser.add_argument(
        "--prompts", metavar="FILE", help="a text file with one prompt a line (blank lines skipped)"
    )
    parser.add_argument(
        "--from-png", metavar="FILE", help="regenerate from the settings stored in a PNG made by rapiddiff"
    )
    parser.add_argument(
        "--model",
        metavar="DIR|builtin:NAME",
        help="model folder, or builtin:NAME for a built-in model (default: the default built-in model; "
        "--list-models names them)",
    )
    parser.add_argument(
        "--list-models",
        action="store_true",
        help="list the built-in models (entities, size, licence) and exit",
    )
    parser.add_argument("--negative", metavar="TEXT", help="negative prompt (what to steer away from)")
    parser.add_argument(
        "--steps",
        type=int,
        help=f"denoising steps (default: the model's, else {_LIBRARY.num_inference_steps})",
    )
    parser.add_argument(
        "--guidance",
        type=float,
        help="classifier-free guidance scale; ≤ 1 turns it off "
        f"(default: the model's, else {_LIBRARY.guidance_scale:g})",
    )
    parser.add_argument(
        "--seed", type=int, help="seed of the first image; image k gets seed+k (default: random)"
    )
    parser.add_argument("--num-images", type=int, default=1, help="images per prompt (default 1)")
    parser.add_argument("--batch-size", type=int, default=4, help="images sampled at once (default 4)")
    parser.add_argument(
        "--size",
        type=parse_size,
        metavar="WxH|N",
        help="image size before upscaling, width first as in the OpenAI images API (192x128: 192 wide, "
        "128 high), or N for N×N (default: the model's)",
    )
    parser.add_argument(
        "--scheduler",
        help=f"sampler: {', '.join(scheduler_choices())} (default: the model's, else {_LIBRARY.scheduler})",
    )
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help=f"named sampling settings in place of the model's ({presets_help()}); --steps, --scheduler "
        "and --deep-cache given beside it win",
    )
    parser.add_argument(
        "--upscale",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="upscale ×4 with the ESRGAN upscaler (default: on when the model has one)",
    )
    parser.add_argument(
        "--upscaler",
        metavar="PATH",
        help="upscaler weights file or folder (instead of the model's upscaler/)",
    )
    parser.add_argument(
        "--init-image",
        metavar="FILE",
        help="img2img / inpainting: the image to start from; resized to the model's size (its longer "
        "side the model's, its aspect kept) unless --size or --keep-init-size is given",
    )
    parser.add_argument(
        "--keep-init-size",
        action="store_true",
        help="with --init-image: sample at the init image's own size (its sides must be multiples of "
        "the model's size multiple; a larger size than the model was trained at draws worse and slower)",
    )
    parser.add_argument(
        "--strength",
        type=float,
        help="with --init-image: how much to change it, 0–1 (default 0.8; 1.0 with --mask)",
    )
    parser.add_argument("--mask", metavar="FILE", help="inpainting: white where --init-image is repainted")
    parser.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="DIR[:SCALE]",
        help="apply a LoRA (a `train finetune` LoRA folder or a diffusers LoRA file) at SCALE (default 1); repeatable",
    )
    control = parser.add_argument_group("ControlNet (one image per net, in the order given)")
    control.add_argument(
        "--controlnet",
        action="append",
        default=[],
        metavar="PATH",
        help="a ControlNet: a diffusers ControlNet folder or a .safetensors file with its config.json beside "
        "it; repeatable, one per --control-image (default: the model folder's controlnet/)",
    )
    control.add_argument(
        "--control-image",
        action="append",
        default=[],
        metavar="FILE",
        help="the control image of the k-th ControlNet (an edge map, pose, depth map...), resized to the "
        "generation size; repeatable",
    )
    for flag, default, what in (
        ("--control-scale", 1.0, "how strongly each net steers (its residuals × S; 0 = off)"),
        ("--control-start", 0.0, "fraction of the steps after which each net starts to act"),
        ("--control-end", 1.0, "fraction of the steps after which each net stops"),
    ):
        control.add_argument(
            flag,
            type=float,
            nargs="+",
            metavar="X",
            help=f"{what}: one value for every net or one per net (default {default:g})",
        )
    parser.add_argument("--out", default="outputs", metavar="DIR", help="output folder (default ./outputs)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    parser.add_argument(
        "--dtype", default="auto", help="auto (fp16 on CUDA, fp32 on CPU), float32, float16 or bfloat16"
    )
    parser.add_argument(
        "--fast",
        action="count",
        default=0,
        help="use the accelerated inference path (rapiddiff.infer.accelerate) on a GPU. On a CPU it is "
        "slower than eager (compile time, no CUDA graphs), so --fast there warns and runs eager; give "
        "it twice (--fast --fast) to use it anyway",
    )
    parser.add_argument(
        "--no-packages",
        action="store_true",
        help="with --fast: no AOTInductor packages. By default --fast loads the packages built for this "
        "model, GPU, torch version and switches, and where they are missing or stale builds them once in "
        "a background process (about 3 min on an H200 at SD 1.5 size) while this one uses torch.compile; "
        "the next process then reaches full speed without compiling",
    )
    parser.add_argument(
        "--deep-cache",
        type=int,
        metavar="N",
        help="opt-in, approximate: run the whole U-Net every N steps and reuse its deep features in "
        "between (DeepCache); faster, at a measured quality cost (see the benchmarks page). Default: exact",
    )
    parser.add_argument(
        "--token-merge",
        type=float,
        metavar="R",
        help="opt-in, approximate: merge the fraction R (0–0.75; ToMe's default 0.5) of the tokens in the "
        "highest-resolution self-attention (ToMe); the images differ from the exact ones at a measured "
        "quality cost and the speed-up is small on the fast path (see the benchmarks page). Default: 0 (exact)",
    )
    parser.add_argument(
        "--no-knowledge", action="store_true", help="switch the knowledge fusion off (the base text encoder)"
    )
    parser.add_argument(
        "--knowledge",
        choices=["embed", "text", "both", "off"],
        help="how KG knowledge enters: embed (fused TransE vectors), text (the entities' facts spelled "
        "into the prompt), both, or off (= --no-knowledge). Default: the model's own mode (saved in its "
        f"text_encoder/rapiddiff_encoder.json; the default built-in model's: {default_knowledge_mode() or 'embed'})",
    )
    parser.add_argument(
        "--no-grid", action="store_true", help="do not write a grid image when several images are made"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(func=run)


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = [args.prompt] if args.prompt is not None else []
    if args.prompts:
        file = Path(args.prompts)
        if not file.is_file():
            raise FileNotFoundError(f"--prompts: file not found: {file}")
        prompts += [line.strip() for _, line in read_text_lines(file, what="--prompts")]
        if not prompts:
            raise ValueError(f"--prompts: {file} holds no prompt (one prompt a line)")
    return prompts


def check_writable(folder: Path) -> None:
    """Fail before any work if images cannot be written to ``folder``."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".rapiddiff-write-test-"):
            pass
    except OSError as err:
        raise PermissionError(
            f"output folder {folder} is not writable ({err.strerror or err}); choose another with --out"
        ) from err


DEFAULT_SAMPLING: dict[str, Any] = _LIBRARY.to_dict()
"""The library's sampling defaults (:class:`rapiddiff.models.sampling.SamplingDefaults`), as kwargs."""


def model_sampling_defaults(model_dir: str | Path) -> dict[str, Any]:
    """The sampling settings a model folder recommends (rapiddiff.json "sampling"), e.g. the
    built-in model's step count; only steps, guidance and scheduler are taken from it."""
    from rapiddiff.models.bundle import read_rapiddiff_info, read_sampling

    given = read_rapiddiff_info(model_dir).get("sampling")
    defaults = read_sampling(model_dir)
    if defaults is None:
        return {}
    return {k: v for k, v in defaults.to_dict().items() if k in given}


def parse_lora(text: str) -> tuple[str, float]:
    """``DIR[:SCALE]`` → (path, scale); a colon followed by a number is the scale."""
    path, sep, scale = text.rpartition(":")
    if sep and path:
        try:
            return path, float(scale)
        except ValueError:
            pass
    return text, 1.0


def _next_index(folder: Path) -> int:
    """First free image number in ``folder`` (files are NNNNN-SEED.png), so runs never overwrite."""
    numbers = [int(m.group(1)) for p in folder.glob("*.png") if (m := re.match(r"(\d{5})-", p.name))]
    return max(numbers, default=0) + 1


def _init_settings(args: argparse.Namespace, kwargs: dict[str, Any]) -> None:
    """The img2img / inpainting flags into ``kwargs`` (over the PNG's), each checked for its init image."""
    if args.init_image:
        kwargs["init_image"] = args.init_image
        kwargs.pop("mask_image", None)  # a new init image: the PNG's mask belongs to the old one
    if args.mask:
        kwargs["mask_image"] = args.mask
    if args.strength is not None:
        kwargs["strength"] = args.strength
    if args.keep_init_size:
        kwargs["init_size"] = "keep"
    for key, flag in (
        ("mask_image", "--mask"),
        ("strength", "--strength"),
        ("init_size", "--keep-init-size"),
    ):
        if key in kwargs and "init_image" not in kwargs:
            raise ValueError(f"{flag} needs --init-image (img2img or inpainting: the image to start from)")


def _settings(args: argparse.Namespace) -> tuple[list[str], dict[str, Any], str | None]:
    """Prompts, pipeline kwargs, and the model folder from the PNG (if --from-png)."""
    from rapiddiff.infer.pipeline import canonical_scheduler_name

    prompts, kwargs, png_model = _from_png(args) if args.from_png else ([], {}, None)
    given = _read_prompts(args)
    if given:
        prompts = given
    if not prompts:
        raise ValueError("no prompt: give one as an argument, --prompts FILE, or --from-png FILE")
    if args.preset:  # over the model's defaults and the PNG's, under the flags below
        kwargs.update(preset(args.preset).settings())
    overrides = {
        "negative_prompt": args.negative,
        "num_inference_steps": args.steps,
        "guidance_scale": args.guidance,
        "seed": args.seed,
        "scheduler": args.scheduler,
        "upscale": args.upscale,
    }
    kwargs.update({k: v for k, v in overrides.items() if v is not None})
    if args.size:
        kwargs["height"], kwargs["width"] = args.size
    _init_settings(args, kwargs)
    _control_settings(args, kwargs)
    _knowledge_and_approximations(args, kwargs)
    if "scheduler" in kwargs:  # bad names fail before loading
        kwargs["scheduler"] = canonical_scheduler_name(kwargs["scheduler"])
    if kwargs.get("num_inference_steps", 1) < 1:
        raise ValueError(f"--steps must be ≥ 1, got {kwargs['num_inference_steps']}")
    if args.num_images < 1 or args.batch_size < 1:
        raise ValueError("--num-images and --batch-size must be ≥ 1")
    return prompts, kwargs, png_model


def _from_png(args: argparse.Namespace) -> tuple[list[str], dict[str, Any], str | None]:
    """The prompt, kwargs and model folder a PNG's settings give; fills --upscaler and --lora
    from it where the command line gives none."""
    from rapiddiff.infer.png import generation_kwargs, read_png_metadata, recorded_model

    meta = read_png_metadata(args.from_png)
    if not meta:
        raise ValueError(f"--from-png: {args.from_png} holds no generation settings")
    recorded = meta.get("control") or []
    if recorded and not args.controlnet:
        args.controlnet = _recorded_controlnets(recorded, args.from_png)
    if args.control_image:  # new control images replace the recorded ones (which need not exist then)
        same = len(args.control_image) == len(recorded)  # then each net keeps its recorded scale and window
        new = [
            {**item, "image": path, "image_sha256": None}
            for item, path in zip(recorded, args.control_image, strict=False)
        ]
        meta = {**meta, "control": new if same else []}
    kwargs = generation_kwargs(meta, where=args.from_png)
    prompts = [kwargs.pop("prompt")]
    if args.upscaler is None and meta.get("upscaler"):
        args.upscaler = meta["upscaler"]
    if not args.lora and meta.get("lora"):
        args.lora = [f"{item['path']}:{item['scale']}" for item in meta["lora"]]
    return prompts, kwargs, recorded_model(meta)


def _recorded_controlnets(items: Any, where: str) -> list[str]:
    """The ControlNets a PNG was made with, each still where it was."""
    nets = [item.get("controlnet") for item in items if isinstance(item, dict)]
    for path in nets:
        if not path or not Path(path).exists():
            raise FileNotFoundError(
                f"{where}: made with the ControlNet {path}, which is not here; give it with --controlnet PATH"
            )
    return [str(p) for p in nets]


def _per_net(values: list[float] | None, count: int, flag: str) -> list[float | None]:
    """One value per net from a flag given once (for every net) or once per net."""
    if not values:
        return [None] * count
    if len(values) == 1:
        return values * count
    if len(values) != count:
        raise ValueError(f"{flag}: {len(values)} values for {count} ControlNet(s); give one, or one per net")
    return list(values)


def _control_settings(args: argparse.Namespace, kwargs: dict[str, Any]) -> None:
    """--controlnet / --control-image / --control-scale/start/end into ``kwargs["control"]`` (over the
    PNG's), one ControlSpec per net."""
    from rapiddiff.models.controlnet import ControlSpec

    if args.control_image:
        if args.controlnet and len(args.controlnet) != len(args.control_image):
            raise ValueError(
                f"{len(args.control_image)} --control-image for {len(args.controlnet)} --controlnet: "
                "give one control image per ControlNet, in the same order"
            )
        if len(kwargs.get("control") or []) != len(args.control_image):  # (else: the PNG's, images replaced)
            kwargs["control"] = [ControlSpec(path) for path in args.control_image]
    elif args.controlnet and "control" not in kwargs:
        raise ValueError("--controlnet needs --control-image (the image that net is conditioned on)")
    specs = kwargs.get("control")
    flags = {"--control-scale": args.control_scale, "--control-start": args.control_start}
    flags["--control-end"] = args.control_end
    given = [flag for flag, values in flags.items() if values]
    if not specs:
        if given:
            raise ValueError(f"{given[0]} needs --control-image (and a ControlNet)")
        return
    scales = _per_net(args.control_scale, len(specs), "--control-scale")
    starts = _per_net(args.control_start, len(specs), "--control-start")
    ends = _per_net(args.control_end, len(specs), "--control-end")
    kwargs["control"] = [
        ControlSpec(
            spec.image,
            controlnet_conditioning_scale=spec.controlnet_conditioning_scale if scale is None else scale,
            control_guidance_start=spec.control_guidance_start if start is None else start,
            control_guidance_end=spec.control_guidance_end if end is None else end,
        )
        for spec, scale, start, end in zip(specs, scales, starts, ends, strict=True)
    ]
    for spec in kwargs["control"]:
        if isinstance(spec.image, str) and not Path(spec.image).is_file():
            raise FileNotFoundError(f"--control-image: file not found: {spec.image}")


def _knowledge_and_approximations(args: argparse.Namespace, kwargs: dict[str, Any]) -> None:
    """--knowledge / --no-knowledge, --deep-cache and --token-merge into ``kwargs``, checked."""
    if args.knowledge:
        kwargs["knowledge"] = args.knowledge
    if args.no_knowledge:
        kwargs["knowledge"] = False
    if args.deep_cache is not None:
        from rapiddiff.models.deep_cache import check_interval

        kwargs["deep_cache"] = check_interval(args.deep_cache, "--deep-cache")
    if args.token_merge is not None:
        from rapiddiff.models.token_merge import check_ratio

        kwargs["token_merge"] = check_ratio(args.token_merge, "--token-merge")


def _model_for(model: str | None, png_model: str | None) -> Path:
    """The --model folder; without one, the model a --from-png image names (``builtin:NAME``, or
    its folder's path), else the default."""
    if model is None and png_model:
        try:
            path = resolve_model_dir(png_model)
        except (ValueError, FileNotFoundError) as err:  # a built-in this installation lacks
            log.warning(
                "the model the PNG names (%s) is not here (%s); using the default model", png_model, err
            )
        else:
            if path.is_dir():
                return path
            log.warning("the model the PNG names (%s) is not here; using the default model", png_model)
    return resolve_model_dir(model)


def use_fast_path(times_asked: int, device: Any) -> bool:
    """Whether ``--fast`` (given ``times_asked`` times) runs the fast path on ``device``. On a CPU it is
    many times slower than eager (compiling, no CUDA graphs to amortise it): once warns and runs
    eager, twice insists."""
    if not times_asked or device.type != "cpu" or times_asked > 1:
        return bool(times_asked)
    log.warning(
        "--fast on a CPU: the fast path is slower than eager there (compile time, no CUDA graphs), so "
        "the eager path runs; give --fast twice to use it anyway"
    )
    return False


def run(args: argparse.Namespace) -> int:
    from rapiddiff.utils.device import resolve_device, resolve_dtype

    if args.list_models:
        from rapiddiff.models.builtin import list_builtins

        print("\n".join(list_builtins()) or "no built-in models in this installation")
        return 0
    prompts, kwargs, png_model = _settings(args)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    out = Path(args.out)
    check_writable(out)
    model_dir = _model_for(args.model, png_model)
    if args.no_packages and not args.fast:
        raise ValueError("--no-packages needs --fast (the packages replace the fast path's torch.compile)")
    fast = use_fast_path(args.fast, device)
    if fast and importlib.util.find_spec("rapiddiff.infer.accelerate") is None:
        raise RuntimeError(
            "--fast: the accelerated path (rapiddiff.infer.accelerate) is not available in this installation"
        )

    from rapiddiff.infer.pipeline import RapidDiffusionPipeline
    from rapiddiff.infer.png import make_readable

    # Flags and --from-png win over the model folder's own defaults (pipe.sampling), which win over ours.
    model_sampling_defaults(model_dir)  # a bad rapiddiff.json fails before the model loads
    loras = [parse_lora(item) for item in args.lora]
    for path, _ in loras:
        if not Path(path).exists():
            raise FileNotFoundError(f"--lora: {path} not found")
    for path in args.controlnet:
        if not Path(path).exists():
            raise FileNotFoundError(
                f"--controlnet: {path} not found (a diffusers ControlNet folder or .safetensors)"
            )

    log.info("loading %s on %s (%s)", model_dir, device, str(dtype).removeprefix("torch."))
    pipe = RapidDiffusionPipeline.from_pretrained(
        model_dir, device=device, dtype=dtype, upscaler=args.upscaler
    )
    for path, scale in loras:  # before the fast path: LoRAs merge into the weights it transforms
        pipe.load_lora(path, scale=scale)
    if args.controlnet:
        pipe.load_controlnet(*args.controlnet)
    if fast:
        from rapiddiff.infer.accelerate import accelerate

        accelerate(pipe, aoti="off" if args.no_packages else "auto")
    if kwargs.get("upscale") is None:
        kwargs["upscale"] = pipe.upscaler is not None
    paths, images = _generate(pipe, prompts, kwargs, args, out)
    if len(images) > 1 and not args.no_grid:
        grid = out / f"{paths[0].name.split('-')[0]}-grid.png"
        with atomic_open(grid, "wb") as handle:
            make_grid(images).save(handle, format="PNG")
        make_readable(grid)
        print(grid)
    building = getattr(pipe.denoiser, "building_packages", lambda: None)()
    if building is not None:
        log.info(
            "the fast path's packages are still being built (pid %d); the next --fast process loads them",
            building,
        )
    return 0


def _generate(
    pipe: Any, prompts: list[str], kwargs: dict[str, Any], args: argparse.Namespace, out: Path
) -> tuple[list[Path], list[Any]]:
    from tqdm.auto import tqdm

    from rapiddiff.infer.png import save_png

    # One job per image (prompt, seed); jobs run in batches of --batch-size through the pipeline.
    jobs = [(p, k) for p in prompts for k in range(args.num_images)]
    first_seed = kwargs.pop("seed", None)
    if first_seed is None:
        import secrets

        first_seed = secrets.randbelow(2**31 - len(jobs))
    index = _next_index(out)
    paths, images = [], []
    bar = tqdm(total=len(jobs), desc="images", unit="img", disable=args.no_progress)
    for start in range(0, len(jobs), args.batch_size):
        batch = jobs[start : start + args.batch_size]
        try:
            result = pipe(
                [p for p, _ in batch],
                seed=[first_seed + start + i for i in range(len(batch))],
                progress=not args.no_progress,
                **kwargs,
            )
        except BaseException:
            bar.leave = False  # the bar's line is cleared, so the error prints on a line of its own
            bar.close()
            raise
        for image, meta in zip(result.images, result.metadata, strict=True):
            path = save_png(image, out / f"{index:05d}-{meta['seed']}.png", meta)
            print(path)
            paths.append(path)
            images.append(image)
            index += 1
        bar.update(len(batch))
    bar.close()
    return paths, images


def make_grid(images: list[Any]) -> Any:
    """PIL images → one PIL grid, about square (torchvision's make_grid, 2-pixel gaps)."""
    import numpy as np
    import torch
    from PIL import Image
    from torchvision.utils import make_grid as tv_grid

    tensors = torch.stack([torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1) for im in images])
    grid = tv_grid(tensors, nrow=math.ceil(math.sqrt(len(images))), padding=2, pad_value=255)
    return Image.fromarray(grid.permute(1, 2, 0).numpy())
