"""ControlNet (Zhang et al. 2023) in the one generation path: loading, the control images, and the
residuals a ControlNet adds to the U-Net at each step.

diffusers does the model work: :class:`diffusers.ControlNetModel` (one net) and
:class:`diffusers.MultiControlNetModel` (several, their residuals summed). This module keeps what
diffusers' ``StableDiffusionControlNetPipeline`` does around them, so that the one loop of
:mod:`rapiddiff.models.sampling` gives its images: the control image resized to the generation
size in [0, 1] RGB (no normalisation), repeated per image and doubled for classifier-free
guidance; each net's ``controlnet_conditioning_scale`` times its ``keep`` at step ``i`` of ``n``
(1 inside ``[control_guidance_start, control_guidance_end]``, else 0: diffusers' rule).

Loading never unpickles: a diffusers folder (``config.json`` + safetensors) or one ``.safetensors``
file through ``ControlNetModel.from_single_file``; a ``.bin``/``.ckpt``/``.pth`` is refused.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rapiddiff.models.weights import PICKLE_FIX, WEIGHT_SUFFIXES, explained
from rapiddiff.utils.io import UnsafeCheckpointError
from rapiddiff.utils.logging import get_logger

if TYPE_CHECKING:
    import torch
    from PIL import Image

log = get_logger(__name__)

CONTROLNET_FOLDER = "controlnet"
"""A model folder's ControlNet (what diffusers' ``StableDiffusionControlNetPipeline.save_pretrained`` writes)."""
CONTROLNET_WEIGHTS = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.fp16.safetensors")


@dataclass
class ControlSpec:
    """One ControlNet's input for a call: its control image and how strongly, and when, it steers.

    The field names are diffusers' (``StableDiffusionControlNetPipeline``), one value per net.
    """

    image: Any
    """The control image: a path or a PIL image (an edge map, a pose, a depth map, ...)."""
    controlnet_conditioning_scale: float = 1.0
    """Multiplies the net's residuals; 0 is the image without this net."""
    control_guidance_start: float = 0.0
    """Fraction of the steps after which the net starts to act."""
    control_guidance_end: float = 1.0
    """Fraction of the steps after which it stops."""

    def __post_init__(self) -> None:
        scale = self.controlnet_conditioning_scale
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
            raise ValueError(f"controlnet_conditioning_scale must be a finite number, got {scale!r}")
        start, end = float(self.control_guidance_start), float(self.control_guidance_end)
        if not 0.0 <= start < end <= 1.0:
            raise ValueError(
                f"control window [{start}, {end}]: need 0 ≤ control_guidance_start < control_guidance_end ≤ 1"
            )
        self.controlnet_conditioning_scale = float(scale)
        self.control_guidance_start, self.control_guidance_end = start, end


def control_specs(control: Any) -> list[ControlSpec]:
    """A call's ``control`` argument → one spec per net: a ControlSpec, a list of them, or a bare
    image (path or PIL) meaning ``ControlSpec(image)``."""
    if control is None:
        return []
    items = list(control) if isinstance(control, list | tuple) else [control]
    return [item if isinstance(item, ControlSpec) else ControlSpec(item) for item in items]


# ------------------------------------------------------------------------------- loading
def load_controlnet(
    path: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> torch.nn.Module:
    """A ControlNet from a diffusers folder or one ``.safetensors`` file (safetensors only).

    A single file in diffusers' key names or the original (``control_model.*``) ones loads through
    ``ControlNetModel.from_single_file``; its config is read from a ``config.json`` beside it,
    since none can be fetched from the Hub offline.
    """
    from diffusers import ControlNetModel

    path = Path(path)
    label = f"ControlNet {path}"
    if not path.exists():
        raise FileNotFoundError(f"{label}: not found (a diffusers ControlNet folder or a .safetensors file)")
    if path.is_dir():
        _require_safetensors_folder(path, label)
        with explained(path, label):
            net = ControlNetModel.from_pretrained(path, use_safetensors=True)
    else:
        if path.suffix != ".safetensors":
            _refuse_pickle(path, label)
        kwargs: dict[str, Any] = {"local_files_only": True}
        if (path.parent / "config.json").is_file():
            kwargs["config"] = str(path.parent)
        try:
            with explained(path, label):
                net = ControlNetModel.from_single_file(str(path), **kwargs)
        except (OSError, ValueError) as err:
            if "config" in kwargs:
                raise
            raise ValueError(
                f"{label}: diffusers could not work out this checkpoint's config offline ({err}); put the "
                "ControlNet's config.json beside the file, or give its diffusers folder instead"
            ) from err
    return net.to(device=device, dtype=dtype).eval().requires_grad_(False)


def _require_safetensors_folder(path: Path, label: str) -> None:
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{label}: no config.json; expected a diffusers ControlNet folder")
    if any((path / name).is_file() for name in CONTROLNET_WEIGHTS):
        return
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES)
    if pickles:
        _refuse_pickle(path / pickles[0], label)
    raise FileNotFoundError(f"{label}: no {CONTROLNET_WEIGHTS[0]} in the folder")


def _refuse_pickle(file: Path, label: str) -> None:
    raise UnsafeCheckpointError(
        f"{label}: {file.name} refused: ControlNets load from safetensors only (a torch pickle can run "
        f"code when loaded). {PICKLE_FIX}"
    )


def combine(nets: Sequence[torch.nn.Module]) -> torch.nn.Module:
    """One net as it is; several as diffusers' ``MultiControlNetModel`` (residuals summed)."""
    if len(nets) == 1:
        return nets[0]
    from diffusers import MultiControlNetModel

    return MultiControlNetModel(list(nets))


def net_count(net: Any) -> int:
    """How many ControlNets ``net`` is (0 for None)."""
    if net is None:
        return 0
    return len(getattr(net, "nets", [net]))


# ------------------------------------------------------------------------------- conditioning
def prepare_control_image(
    image: Image.Image,
    height: int,
    width: int,
    *,
    vae_scale_factor: int,
    count: int,
    guided: bool,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    """PIL → [count (×2 with guidance), 3, H, W] in [0, 1], as diffusers' ``prepare_image``: resized to
    the generation size, RGB, not normalised; rows for the unconditional half first, as the context."""
    import torch
    from diffusers.image_processor import VaeImageProcessor

    processor = VaeImageProcessor(vae_scale_factor=vae_scale_factor, do_convert_rgb=True, do_normalize=False)
    pixels = processor.preprocess(image, height=height, width=width).to(torch.float32)  # (1, 3, H, W)
    pixels = pixels.repeat_interleave(count, dim=0).to(device=device, dtype=dtype)
    return torch.cat([pixels] * 2) if guided else pixels


@dataclass
class ControlConditioning:
    """What the denoising loop needs from the ControlNet(s): the net, its prepared images and each
    net's scale and window."""

    net: torch.nn.Module  # a ControlNetModel or a MultiControlNetModel
    images: list[torch.Tensor]  # one per net: (2N or N, 3, H, W) in [0, 1]
    scales: list[float]
    starts: list[float]
    ends: list[float]

    def keep(self, i: int, n: int) -> list[float]:
        """Per net, 1 where step ``i`` of ``n`` lies in its window, else 0 (diffusers' ``controlnet_keep``)."""
        return [
            1.0 - float(i / n < s or (i + 1) / n > e) for s, e in zip(self.starts, self.ends, strict=True)
        ]

    def residuals(
        self, x_in: torch.Tensor, t: torch.Tensor, context: torch.Tensor, i: int, n: int
    ) -> dict[str, Any]:
        """The U-Net keyword arguments of step ``i`` of ``n``: the nets' down-block and mid-block
        residuals for the scaled model input ``x_in`` [2N or N, C, h, w] (before any inpainting
        channels are concatenated, as diffusers' ControlNet inpainting pipeline does)."""
        scales = [s * k for s, k in zip(self.scales, self.keep(i, n), strict=True)]
        dtype = self.net.dtype
        multi = len(self.images) > 1
        down, mid = self.net(
            x_in.to(dtype),
            t,
            encoder_hidden_states=context.to(dtype),
            controlnet_cond=self.images if multi else self.images[0],
            conditioning_scale=scales if multi else scales[0],
            return_dict=False,
        )
        # The U-Net may run in another dtype (the fast path's): its residuals must match it.
        return {
            "down_block_additional_residuals": [d.to(x_in.dtype) for d in down],
            "mid_block_additional_residual": mid.to(x_in.dtype),
        }


__all__ = [
    "CONTROLNET_FOLDER",
    "ControlConditioning",
    "ControlSpec",
    "combine",
    "control_specs",
    "load_controlnet",
    "net_count",
    "prepare_control_image",
]
