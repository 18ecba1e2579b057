"""The image sizes a U-Net and VAE pair allows, as properties shared by the model bundle and the pipeline."""

from __future__ import annotations

from typing import Any


class ImageGeometry:
    """``vae_scale_factor``, ``size_multiple`` and ``default_size`` of an object with ``unet`` and ``vae``."""

    unet: Any
    vae: Any

    # The functions live in models.sampling, which imports torch: deferred so that reading a model
    # folder's files (ModelBundle) stays light until a size is asked for.
    @property
    def vae_scale_factor(self) -> int:
        from rapiddiff.models.sampling import vae_scale_factor

        return vae_scale_factor(self.vae)

    @property
    def size_multiple(self) -> int:
        from rapiddiff.models.sampling import size_multiple

        return size_multiple(self.unet, self.vae)

    @property
    def default_size(self) -> int:
        from rapiddiff.models.sampling import default_size

        return default_size(self.unet, self.vae)
