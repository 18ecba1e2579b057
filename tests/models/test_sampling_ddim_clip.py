"""DDIM built from a PNDM scheduler file: no x0 clipping in latent space unless the file asks for it."""

from __future__ import annotations

from rapiddiff.models.presets import scheduler_config
from rapiddiff.models.sampling import make_scheduler


def test_ddim_from_a_pndm_file_does_not_clip_latents() -> None:
    config = (
        scheduler_config()
    )  # SD 1.x's PNDM settings, as every folder our stages write: no clip_sample key
    assert "clip_sample" not in config
    assert make_scheduler("ddim", config).config.clip_sample is False


def test_ddim_keeps_an_explicit_clip_sample() -> None:
    assert make_scheduler("ddim", {**scheduler_config(), "clip_sample": True}).config.clip_sample is True
