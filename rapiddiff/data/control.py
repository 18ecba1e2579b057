"""Conditioning images for ControlNet, made from a training image on the fly: ``mask`` and ``canny``.

A conditioning image is ``[3, H, W]`` in [0, 1] (white = the feature, black = none), the range
diffusers' ControlNet pipelines feed a ControlNet (its image processor does not normalise to
[-1, 1]) and examples/controlnet/train_controlnet.py trains with (``ToTensor`` only).

- ``mask``: the object, i.e. every pixel whose colour differs from the flat background — the
  background being the median colour of the image's border. kshapes and emoji-zh draw one object
  on a flat shade, so this is their object mask; ``benchmarks/controlnet_mask_iou.py`` reads a
  generated image's object with the same rule. (The builders can also write the exact mask as a
  ``mask`` column: ``rapiddiff data kshapes --masks``.)
- ``canny``: Canny's edge detector (Sobel gradients, non-maximum suppression, hysteresis), with
  OpenCV's usual ControlNet thresholds (100, 200 on 0–255 intensities). Neither OpenCV nor
  scikit-image is a dependency of the project, so it is written here on scipy.ndimage (a
  dependency already), in ~30 lines.

There is no ``depth``-like transform: no depth estimator is installed or can be downloaded. A
depth (or pose, scribble, ...) ControlNet trains from a column of such images in the data.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from rapiddiff.data.images import BadImageError, image_source, open_image, to_rgb
from rapiddiff.data.loader import ImageTextDataset, Verify
from rapiddiff.data.transforms import ImageTransform

MASK_THRESHOLD = 20.0
"""The least CIELAB ΔE76 from the background colour at which a pixel can be the object: half of
kshapes' MIN_CONTRAST (40), well above the builders' background jitter (±4 per channel, ΔE < 5)
and a generated image's noise."""


def to_uint8_rgb(pixels: torch.Tensor | np.ndarray) -> np.ndarray:
    """A ``[3, H, W]`` tensor in [-1, 1] (the training transform's output) or an ``(H, W, 3)``
    uint8 array → ``(H, W, 3)`` uint8."""
    if isinstance(pixels, torch.Tensor):
        array = ((pixels.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round()
        return array.to(torch.uint8).permute(1, 2, 0).numpy()
    array = np.asarray(pixels)
    if array.dtype != np.uint8 or array.ndim != 3 or array.shape[-1] != 3:
        raise ValueError(f"expected an (H, W, 3) uint8 image, got {array.dtype} {array.shape}")
    return array


def object_mask(rgb: np.ndarray, threshold: float = MASK_THRESHOLD) -> np.ndarray:
    """``(H, W)`` bool: the pixels of an ``(H, W, 3)`` uint8 image whose CIELAB colour lies more
    than half as far from the background (the median of a border frame) as the object's farthest
    colour does (the 99.9th percentile), and at least ``threshold`` ΔE; holes filled. Half-way:
    an anti-aliased edge pixel is the object when it is about half covered, as a drawn mask
    thresholded at 128 has it."""
    from scipy import ndimage

    from rapiddiff.data.kshapes.palette import srgb_to_lab

    lab = srgb_to_lab(np.asarray(rgb, dtype=np.float32) / 255.0)
    h, w = lab.shape[:2]
    frame = max(1, min(h, w) // 64)
    border = np.concatenate(
        [lab[:frame].reshape(-1, 3), lab[-frame:].reshape(-1, 3), lab[:, :frame].reshape(-1, 3),
         lab[:, -frame:].reshape(-1, 3)]
    )  # fmt: skip
    background = np.median(border, axis=0)
    distance = np.linalg.norm(lab - background, axis=-1)
    mask = distance > max(threshold, 0.5 * float(np.percentile(distance, 99.9)))
    # An object's own parts in the background's colour (an emoji's light detail) stay the object.
    return ndimage.binary_fill_holes(mask)


def canny(gray: np.ndarray, low: float = 100.0, high: float = 200.0) -> np.ndarray:
    """Canny (1986) edges of an ``(H, W)`` image of 0–255 intensities, as OpenCV's ``Canny(img,
    low, high, L2gradient=True)`` computes them: 3×3 Sobel gradients, non-maximum suppression
    along the gradient's direction (quantised to 0/45/90/135°), hysteresis (weak edges kept where
    connected to a strong one)."""
    from scipy import ndimage

    g = np.asarray(gray, dtype=np.float32)
    gx, gy = ndimage.sobel(g, axis=1, mode="nearest"), ndimage.sobel(g, axis=0, mode="nearest")
    magnitude = np.hypot(gx, gy)
    angle = (np.degrees(np.arctan2(gy, gx)) + 180.0) % 180.0
    direction = ((angle + 22.5) // 45).astype(int) % 4  # 0: horizontal gradient, 1: 45°, 2: 90°, 3: 135°
    padded = np.pad(magnitude, 1)
    h, w = g.shape
    ahead = {0: (0, 1), 1: (1, 1), 2: (1, 0), 3: (1, -1)}  # (dy, dx) along the gradient
    peak = np.zeros_like(magnitude, dtype=bool)
    for d, (dy, dx) in ahead.items():
        forward = padded[1 + dy : 1 + dy + h, 1 + dx : 1 + dx + w]
        backward = padded[1 - dy : 1 - dy + h, 1 - dx : 1 - dx + w]
        peak |= (direction == d) & (magnitude >= forward) & (magnitude > backward)
    weak = peak & (magnitude >= low)
    labels, _ = ndimage.label(weak, structure=np.ones((3, 3)))
    strong = np.unique(labels[peak & (magnitude >= high)])
    return np.isin(labels, strong[strong > 0])


def _as_control(binary: np.ndarray) -> torch.Tensor:
    """(H, W) bool → ``[3, H, W]`` float in {0, 1}."""
    return torch.from_numpy(binary.astype(np.float32)).expand(3, *binary.shape).contiguous()


def mask_control(pixels: torch.Tensor | np.ndarray) -> torch.Tensor:
    """The ``mask`` conditioning image of a training image (see :func:`object_mask`)."""
    return _as_control(object_mask(to_uint8_rgb(pixels)))


def canny_control(pixels: torch.Tensor | np.ndarray) -> torch.Tensor:
    """The ``canny`` conditioning image of a training image (edges of its luma, ITU-R 601)."""
    rgb = to_uint8_rgb(pixels).astype(np.float32)
    return _as_control(canny(rgb @ np.array([0.299, 0.587, 0.114], dtype=np.float32)))


CONTROL_TRANSFORMS: dict[str, Callable[[torch.Tensor | np.ndarray], torch.Tensor]] = {
    "mask": mask_control,
    "canny": canny_control,
}
"""Conditioning types made on the fly from the training image (others come from a data column)."""


def control_transform(name: str) -> Callable[[torch.Tensor | np.ndarray], torch.Tensor]:
    """The transform called ``name``; an unknown one names the choices and the column route."""
    if name not in CONTROL_TRANSFORMS:
        raise ValueError(
            f"no on-the-fly conditioning transform {name!r} (there are: {', '.join(CONTROL_TRANSFORMS)}; "
            "no depth estimator is installed); give the conditioning images as a path column of the "
            "data instead (data.control.column)"
        )
    return CONTROL_TRANSFORMS[name]


# ----------------------------------------------------------------------------- the dataset
class ControlImageTextDataset(ImageTextDataset):
    """:class:`~rapiddiff.data.loader.ImageTextDataset` whose items also carry ``"control"``, the
    conditioning image ``[3, H, W]`` in [0, 1] at the training size.

    ``control_column``: a column of the table with each row's conditioning image (a path relative
    to the folder, as ``file_name``; or base64), resized and centre-cropped as the image is; a row
    whose conditioning image is missing or unreadable is skipped, counted and named like a bad
    image (``.skipped``, ``skip_log``). Otherwise ``transform_name`` (``mask``, ``canny``) makes it
    from the item's own transformed pixels, so any crop or flip of the image applies to it too.
    """

    def __init__(
        self,
        source: Any,
        *,
        control_column: str | None = None,
        transform_name: str | None = None,
        **options: Any,
    ) -> None:
        if (control_column is None) == (transform_name is None):
            raise ValueError("give exactly one of control_column (a data column) or transform_name")
        if control_column is not None and (options.get("hflip") or options.get("crop", "center") != "center"):
            raise ValueError(
                "conditioning images from a column are centre-cropped and never flipped: set "
                "crop: center and hflip: false (a transform such as mask follows the image's own crop)"
            )
        self.control_column = control_column
        self.make_control = control_transform(transform_name) if transform_name else None
        self._control_resize = ImageTransform(options.get("image_size", 256))
        self._column_checked = False
        super().__init__(source, **options)
        if control_column is not None:
            self._control_cell(self.indices[0] if self.indices else 0)  # the column exists

    def _check_image(self, row: int, value: Any, verify: Verify) -> str | None:
        reason = super()._check_image(row, value, verify)
        if reason is not None or self.control_column is None:
            return reason
        try:
            with open_image(image_source(self._control_cell(row), self.base_dir)) as image:
                if verify == "full":
                    to_rgb(image)
        except BadImageError as err:
            return f"conditioning image: {err}"
        return None

    def _control_cell(self, row: int) -> Any:
        assert self.control_column is not None
        if not self._column_checked:
            if self.control_column not in self._rows.column_names:
                columns = [c for c in self._rows.column_names if not c.startswith("__rapiddiff")]
                raise ValueError(
                    f"{self.table}: no conditioning column {self.control_column!r}; columns are "
                    f"{', '.join(columns)}. kshapes and emoji-zh write a `mask` column when built with "
                    "--masks; or make the images on the fly (data.control.transform: mask or canny)"
                )
            self._column_checked = True
        return self._rows.data.column(self.control_column)[row].as_py()

    def load_control(self, j: int) -> torch.Tensor:
        """Item ``j``'s conditioning image from its column, ``[3, H, W]`` in [0, 1]."""
        try:
            source = image_source(self._control_cell(self.indices[j]), self.base_dir)
            image = to_rgb(open_image(source))
        except BadImageError as err:
            raise BadImageError(f"conditioning image: {err}") from err
        return (self._control_resize(image) + 1) / 2

    def item(self, j: int) -> dict[str, Any]:
        item = super().item(j)
        if self.make_control is None:
            item["control"] = self.load_control(j)
            return item
        # A cached-latents run stops decoding images, but a transform needs them.
        pixels = item["pixel_values"] if "pixel_values" in item else self.transform(self.load_image(j))
        item["control"] = self.make_control(pixels)
        return item
