"""A latent-diffusion model folder: U-Net, VAE, noise schedule, text encoder, optional upscaler.

The folder is diffusers' Stable Diffusion layout, so a plain SD 1.x folder (CLIP text tower) and
a Taiyi-style one (BERT text tower) load as they are, and what :func:`save_model_folder` writes,
``diffusers.StableDiffusionPipeline.from_pretrained`` loads (knowledge aside)::

    model_index.json    diffusers' component table (StableDiffusionPipeline)
    unet/ vae/ scheduler/ text_encoder/ tokenizer/
    knowledge/          KnowledgeStore + fusion weights (KnowledgeTextEncoder's)   — rapiddiff only
    upscaler/           upscaler.safetensors (ESRGAN, spandrel-loadable)           — rapiddiff only
    rapiddiff.json      what the two extra folders hold, and the rapiddiff version

diffusers only loads the components that ``model_index.json`` names and ignores other folders;
``knowledge/`` and ``upscaler/`` are therefore recorded in ``rapiddiff.json``, not there
(diffusers would try to import a loader for any entry of ``model_index.json``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rapiddiff.models.builtin import model_id
from rapiddiff.models.geometry import ImageGeometry
from rapiddiff.models.weights import diagnose
from rapiddiff.utils.io import atomic_write_text, read_json_object
from rapiddiff.utils.logging import get_logger

if TYPE_CHECKING:
    import torch
    from torch import nn

    from rapiddiff.models.sampling import SamplingDefaults
    from rapiddiff.models.text_encoder import KnowledgeTextEncoder

log = get_logger(__name__)

RAPIDDIFF_FILE = "rapiddiff.json"
# Weight files each part may hold, the preferred first (diffusers / transformers names; the
# ``fp16`` variant is what many SD 1.x folders on the Hub ship; ``.bin`` loads weights-only).
_WEIGHT_FILES = {
    "unet": ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin",
             "diffusion_pytorch_model.fp16.safetensors", "diffusion_pytorch_model.fp16.bin"),
    "vae": ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin",
            "diffusion_pytorch_model.fp16.safetensors", "diffusion_pytorch_model.fp16.bin"),
    "text_encoder": ("model.safetensors", "pytorch_model.bin"),
}  # fmt: skip


@dataclass
class ModelBundle(ImageGeometry):
    """The parts of a text-to-image model; ``path`` is the folder it came from (if any)."""

    unet: nn.Module
    vae: nn.Module
    scheduler: Any
    text_encoder: KnowledgeTextEncoder
    upscaler: nn.Module | None = None
    path: Path | None = None
    sampling: SamplingDefaults | None = None
    """Sampling settings the folder recommends (steps, guidance, scheduler; ``rapiddiff.json``);
    a dict is turned into :class:`~rapiddiff.models.sampling.SamplingDefaults` (and checked)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "sampling" and isinstance(value, dict):
            from rapiddiff.models.sampling import SamplingDefaults

            value = SamplingDefaults.from_dict(value)
        super().__setattr__(name, value)

    @property
    def name(self) -> str:
        """``builtin:NAME`` for a built-in model, else the folder's name (what PNGs record)."""
        return model_id(self.path) if self.path is not None else "model"

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> ModelBundle:
        """Move every part to ``device``/``dtype`` (in place); returns the bundle."""
        for module in (self.unet, self.vae, self.text_encoder):
            module.to(device=device, dtype=dtype)
        if self.upscaler is not None:
            self.upscaler.to(device=device, dtype=dtype)
        return self

    def check(self) -> None:
        """Raise when the parts cannot work together (text width ≠ U-Net cross-attention width)."""
        check_parts(
            self.unet, self.vae, self.text_encoder, where=f"model folder {self.path}: " if self.path else ""
        )


def check_model_folder(path: Path) -> None:
    """A model folder must be a folder: a weights file given for one is named as such."""
    if path.is_file():
        raise ValueError(
            f"{path} is a file, but a model folder is expected (model_index.json, unet/, vae/, "
            "text_encoder/, ...); LoRA weights go to --lora, upscaler weights to --upscaler"
        )
    if not path.is_dir():
        raise FileNotFoundError(f"model folder not found: {path}")


def check_parts(
    unet: nn.Module, vae: nn.Module, text_encoder: KnowledgeTextEncoder, *, where: str = ""
) -> None:
    """Raise when U-Net, VAE and text encoder cannot work together (widths, latent channels)."""
    width = text_encoder.hidden_size
    cross = unet.config.cross_attention_dim
    if width != cross:
        raise ValueError(
            f"{where}the text encoder outputs {width}-wide states but the U-Net's cross_attention_dim is "
            f"{cross}: pick a U-Net of width {width}, or give the text encoder out_dim={cross}"
        )
    latent = vae.config.latent_channels
    if unet.config.in_channels not in (latent, 2 * latent + 1):  # 2C + 1: an inpainting U-Net
        raise ValueError(
            f"{where}U-Net in_channels={unet.config.in_channels} ≠ VAE latent_channels={latent} "
            f"(or {2 * latent + 1} for an inpainting U-Net)"
        )


# ---------------------------------------------------------------------------------------- load
def load_model_folder(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    *,
    knowledge: bool = True,
    load_upscaler: bool = True,
) -> ModelBundle:
    """Load a rapiddiff, diffusers SD 1.x or Taiyi-style model folder.

    A missing or unreadable part raises an error naming the folder, the part and the file.
    ``knowledge=False`` loads the text encoder with its fusion switched off (the base encoder).
    """
    import torch

    path = Path(path)
    check_model_folder(path)
    from rapiddiff.models.lora import is_lora_folder, read_info

    if is_lora_folder(path):
        base = read_info(path).get("base")
        raise ValueError(
            f"{path} is a LoRA, not a model folder; use --model {base or 'BASE'} --lora {path} "
            "(in Python: pipe.load_lora(path)), or fold it in with `rapiddiff train finetune merge`"
        )
    dtype = dtype or torch.float32
    for part in ("unet", "vae", "text_encoder"):
        _require_weights(path, part)
    for part, file in (("tokenizer", None), ("scheduler", "scheduler_config.json")):
        where = path / part / file if file else path / part
        if not where.exists():
            raise FileNotFoundError(f"model folder {path}: {where.relative_to(path)} is missing")

    unet = _load_diffusers_part(path, "unet", "UNet2DConditionModel", dtype)
    vae = _load_diffusers_part(path, "vae", "AutoencoderKL", dtype)
    scheduler = _load_scheduler(path)
    text_encoder = _load_text_encoder(path, knowledge)
    upscaler = None
    if load_upscaler and (path / "upscaler").is_dir():
        from rapiddiff.models.upscaler import load_upscaler as _load

        try:
            upscaler = _load(path / "upscaler")
        except (FileNotFoundError, ValueError, RuntimeError) as err:
            raise type(err)(f"model folder {path}: upscaler/: {err}") from err
    sampling = read_sampling(path)
    bundle = ModelBundle(unet, vae, scheduler, text_encoder, upscaler, path=path, sampling=sampling)
    bundle.check()
    unet.eval().requires_grad_(False)
    vae.eval().requires_grad_(False)
    text_encoder.eval().requires_grad_(False)
    bundle.unet.to(device)
    bundle.vae.to(device)
    bundle.text_encoder.to(device=device, dtype=dtype)
    if upscaler is not None:
        upscaler.to(device=device)
    return bundle


def _require_weights(path: Path, part: str) -> None:
    folder = path / part
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"model folder {path}: {part}/config.json is missing")
    if _weights_file(path, part) is None and not any(folder.glob("*.index.json")):  # index: sharded
        raise FileNotFoundError(f"model folder {path}: {part}/{_WEIGHT_FILES[part][0]} is missing")


def _weights_file(path: Path, part: str) -> str | None:
    for name in _WEIGHT_FILES[part]:
        if (path / part / name).is_file():
            return f"{part}/{name}"
    return None


# The diffusers classes a model folder's unet/ and vae/ name, by the file each lives in. Importing
# them from there with the model zoos' package __init__s deferred (rapiddiff.utils.imports) skips
# importing a few hundred unrelated model classes; any other class comes through diffusers' top level.
_DIFFUSERS_MODULES = {
    "UNet2DConditionModel": "diffusers.models.unets.unet_2d_condition",
    "AutoencoderKL": "diffusers.models.autoencoders.autoencoder_kl",
}
_DIFFUSERS_DEFERRED = (
    "transformers.models",  # diffusers' LoRA loader imports transformers.PreTrainedModel
    "diffusers.hooks",
    "diffusers.models.transformers",
    "diffusers.models.unets",
    "diffusers.models.autoencoders",
)


def diffusers_class(name: str) -> Any:
    """The diffusers class called ``name`` (None if diffusers has none), imported as cheaply as it can be."""
    module = _DIFFUSERS_MODULES.get(name)
    if module is not None:
        from rapiddiff.utils.imports import import_module

        return getattr(import_module(module, defer=_DIFFUSERS_DEFERRED), name)
    import diffusers

    return getattr(diffusers, name, None)


def _load_diffusers_part(path: Path, part: str, class_name: str, dtype: torch.dtype) -> nn.Module:
    cls = diffusers_class(class_name)
    file = _weights_file(path, part)
    try:
        model = _load_own_weights(cls, path / part, path / file, dtype) if file else None
        if model is not None:
            return model
        # A folder with only the fp16 variant loads through diffusers' variant argument.
        variant = "fp16" if file is not None and ".fp16." in file else None
        return cls.from_pretrained(str(path / part), torch_dtype=dtype, variant=variant)
    except Exception as err:  # diffusers raises many types (OSError, EnvironmentError, safetensors errors)
        reason = diagnose(path / file, f"model folder {path}: {file}") if file else None  # truncated/pickle
        raise reason or ValueError(
            f"model folder {path}: {file or part + '/'} could not be loaded as {class_name} ({err})"
        ) from err


def _load_own_weights(cls: Any, folder: Path, file: Path, dtype: torch.dtype) -> nn.Module | None:
    """diffusers' ``from_pretrained`` for the folders rapiddiff writes: the module built on the meta
    device from ``config.json``, then ``file``'s tensors put in place in one ``load_state_dict``.

    Why not ``cls.from_pretrained``: for a 19 MB model it spends ~0.5 s of CPU in per-tensor casts
    and checks (3,761 ``Tensor.to`` calls for the built-in U-Net and VAE) — about 5 % of a cold
    ``rapiddiff generate``. The result is the same module (config, weights, dtype, eval mode;
    tests/models/test_fast_load.py compares them); anything this does not cover — another class,
    a ``.bin`` or sharded or fp16-variant file, keys that are not exactly the module's own (old
    attention names diffusers renames) — returns None and goes through ``from_pretrained``.
    """
    import torch
    from safetensors.torch import load_file

    if cls.__name__ not in _DIFFUSERS_MODULES or file.name != _WEIGHT_FILES[folder.name][0]:
        return None
    if getattr(cls, "_keep_in_fp32_modules", None):
        return None  # a mixed-dtype load: diffusers' rules
    config = read_json_object(folder / "config.json")
    state = load_file(file)
    with torch.device("meta"):
        model = cls.from_config(config)
    own = model.state_dict()
    made_by_init = [b for name, b in model.named_buffers() if name not in own]
    if set(state) != set(own) or any(b.is_meta for b in made_by_init):
        return None  # other key names, or a buffer only __init__ makes (left on meta): the general path
    if any(state[k].shape != v.shape for k, v in own.items()):
        return None  # diffusers' loader names the mismatching tensor
    model.load_state_dict({k: cast(v, dtype) for k, v in state.items()}, strict=True, assign=True)
    model.register_to_config(_name_or_path=str(folder))  # what from_pretrained records
    return model.eval()


def cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor.to(dtype)`` for a CPU weight; float16 → float32 through numpy.

    The values are the same (widening a float16 is exact; tests compare the bits), but torch runs
    each cast on its intra-op threads, and on a busy 2-core machine waking them costs ~1 ms a
    tensor: 0.7 s for the built-in U-Net's 402 float16 tensors at load 5, against 0.04 s in numpy,
    which casts on the calling thread.
    """
    import torch

    if tensor.dtype == torch.float16 and dtype == torch.float32 and tensor.device.type == "cpu":
        return torch.from_numpy(tensor.numpy().astype("float32"))
    return tensor.to(dtype)


def _load_scheduler(path: Path) -> Any:
    file = path / "scheduler" / "scheduler_config.json"
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(
            f"model folder {path}: scheduler/scheduler_config.json is not valid JSON ({err})"
        ) from err
    name = config.get("_class_name", "PNDMScheduler")
    cls = diffusers_class(name)
    if cls is None or not hasattr(cls, "from_config"):
        raise ValueError(
            f"model folder {path}: scheduler/scheduler_config.json names unknown scheduler {name!r}"
        )
    return cls.from_config(config)


def _load_text_encoder(path: Path, knowledge: bool) -> KnowledgeTextEncoder:
    from rapiddiff.models.text_encoder import KnowledgeTextEncoder

    try:
        return KnowledgeTextEncoder.from_pretrained(path, knowledge=knowledge)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"model folder {path}: text encoder: {err}") from err
    except Exception as err:
        file = _weights_file(path, "text_encoder")
        reason = diagnose(path / file, f"model folder {path}: {file}") if file else None  # truncated/pickle
        raise reason or ValueError(
            f"model folder {path}: {file or 'text_encoder/'} (or tokenizer/, knowledge/) "
            f"could not be loaded ({err})"
        ) from err


# ---------------------------------------------------------------------------------------- save
def save_model_folder(bundle: ModelBundle, path: str | Path) -> Path:
    """Write ``bundle`` as a model folder that diffusers loads (and rapiddiff, with knowledge).

    The folder is written beside ``path`` first and moved into place at the end, so an
    interrupted save never leaves a half-written model where a good one was.
    """
    import diffusers

    from rapiddiff import __version__

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        bundle.unet.save_pretrained(tmp / "unet", safe_serialization=True)
        bundle.vae.save_pretrained(tmp / "vae", safe_serialization=True)
        bundle.scheduler.save_pretrained(tmp / "scheduler")
        bundle.text_encoder.save_pretrained(tmp)
        extras: dict[str, Any] = {"rapiddiff_version": __version__}
        if bundle.text_encoder.store is not None:
            extras["knowledge"] = "knowledge/"
        if bundle.upscaler is not None:
            from rapiddiff.models.upscaler import save_upscaler

            extras["upscaler"] = str(save_upscaler(bundle.upscaler, tmp / "upscaler").relative_to(tmp))
        if bundle.sampling is not None:
            extras["sampling"] = bundle.sampling.to_dict()
        text_model = bundle.text_encoder.text_model
        index = {
            "_class_name": "StableDiffusionPipeline",
            "_diffusers_version": diffusers.__version__,
            "feature_extractor": [None, None],
            "image_encoder": [None, None],
            "requires_safety_checker": False,
            "safety_checker": [None, None],
            "scheduler": ["diffusers", type(bundle.scheduler).__name__],
            "text_encoder": ["transformers", type(text_model).__name__],
            "tokenizer": ["transformers", type(bundle.text_encoder.tokenizer).__name__],
            "unet": ["diffusers", type(bundle.unet).__name__],
            "vae": ["diffusers", type(bundle.vae).__name__],
        }
        atomic_write_text(tmp / "model_index.json", json.dumps(index, indent=2) + "\n")
        atomic_write_text(tmp / RAPIDDIFF_FILE, json.dumps(extras, indent=2, ensure_ascii=False) + "\n")
        _install(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    bundle.path = path
    return path


# What save_model_folder writes into a folder; anything else already there (notes, samples, logs)
# is left alone, and a part the new bundle lacks (e.g. knowledge/) is removed, never left stale.
_MANAGED = (
    "model_index.json", RAPIDDIFF_FILE, "unet", "vae", "scheduler", "text_encoder", "tokenizer", "knowledge", "upscaler",
)  # fmt: skip


def _install(new: Path, target: Path) -> None:
    """Move the parts written in ``new`` into ``target``; the old parts are deleted only at the end."""
    if not target.exists():
        os.replace(new, target)
        return
    if not target.is_dir():
        raise FileExistsError(f"{target} exists and is not a folder")
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    moved: list[str] = []
    try:
        for name in _MANAGED:
            if (target / name).exists():
                os.replace(target / name, old / name)
                moved.append(name)
        for child in new.iterdir():
            os.replace(child, target / child.name)
    except BaseException:
        for name in moved:  # put the previous model back
            if (target / name).exists():
                shutil.rmtree(target / name) if (target / name).is_dir() else (target / name).unlink()
            os.replace(old / name, target / name)
        shutil.rmtree(old, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    new.rmdir()


def read_rapiddiff_info(path: str | Path) -> dict[str, Any]:
    """The folder's rapiddiff.json (empty for a plain diffusers folder)."""
    return read_json_object(Path(path) / RAPIDDIFF_FILE)


def read_sampling(path: str | Path) -> SamplingDefaults | None:
    """The folder's sampling defaults (rapiddiff.json "sampling"), checked; None when it has none."""
    from rapiddiff.models.sampling import SamplingDefaults

    given = read_rapiddiff_info(path).get("sampling")
    if given is None:
        return None
    return SamplingDefaults.from_dict(given, f"{Path(path) / RAPIDDIFF_FILE}: sampling")
