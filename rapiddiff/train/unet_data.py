"""The U-Net stage's data on the device: cached latents, and with ``speed.gpu_data`` the whole
training set resident, batches gathered there."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # typed as the base class: unet.py imports this module
    from rapiddiff.train.module import RapidModule as LatentDiffusion


@torch.no_grad()
def encode_dataset(module: LatentDiffusion, loader: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE's latent parameters of every training image (rows by source index), and which rows
    were filled (items that failed to decode leave theirs empty)."""
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm

    dataset = getattr(loader.dataset, "source", loader.dataset)  # an index loader's dataset
    workers = getattr(module.trainer.datamodule, "num_workers", loader.num_workers) if module._trainer else 0
    plain = DataLoader(dataset, batch_size=loader.batch_size, num_workers=workers, shuffle=False)
    # Items are indexed by their row in the source table (skipped rows leave gaps).
    positions = getattr(dataset, "indices", None)
    rows = max(positions) + 1 if positions else len(dataset)
    cache: torch.Tensor | None = None
    filled = torch.zeros(rows, dtype=torch.bool)
    quiet = module._trainer is not None and not module.trainer.is_global_zero
    for batch in tqdm(plain, desc="caching latents", disable=quiet):
        params = module.vae.encode(
            batch["pixel_values"].to(module.device, module.vae.dtype)
        ).latent_dist.parameters
        if cache is None:
            cache = torch.empty((rows, *params.shape[1:]), dtype=torch.float32)
        cache[batch["index"]] = params.float().cpu()
        filled[batch["index"]] = True
    assert cache is not None
    if positions is not None and hasattr(dataset, "mark_failed"):
        # Items that failed to decode in the workers were replaced there by the next good one,
        # leaving their cache rows empty: skip them for the rest of training too.
        dataset.mark_failed(j for j, row in enumerate(positions) if not filled[row])
    return cache, filled


class ResidentData:
    """The training set on the device (``speed.gpu_data``): latent parameters, tokens per caption,
    and with ``speed.cache_text`` the caption hidden states. A batch is gathered from the sampler's
    positions with the plain step's random draws, in its order (latent sample on the device,
    caption dropout from the host generator)."""

    def __init__(
        self,
        latents: torch.Tensor,
        rows: torch.Tensor,
        captions: torch.Tensor,
        empty: int,
        tokens: dict[str, torch.Tensor],
        states: torch.Tensor | None,
    ) -> None:
        self.latents = latents  # (N_rows, 2·C, h, w) mean ‖ logvar, float32
        self.rows = rows  # (N,) position → source row (failed items → the next good one)
        self.captions = captions  # (N,) position → distinct-caption id
        self.empty = empty  # the id of "" (caption dropout)
        self.tokens = tokens  # {name: (U, L)} per distinct caption
        self.states = states  # (U, L, D) or None

    @classmethod
    @torch.no_grad()
    def build(cls, module: LatentDiffusion, dataset: Any) -> ResidentData:
        if module._latents is None or not hasattr(dataset, "texts") or not hasattr(dataset, "indices"):
            raise ValueError(
                "speed.gpu_data needs cached latents and an ImageTextDataset (with .texts and .indices); "
                f"got {type(dataset).__name__}"
            )
        filled = getattr(module, "_filled", None)
        rows: list[int] = list(dataset.indices)
        good = [j for j, r in enumerate(rows) if filled is None or bool(filled[r])]
        if not good:
            raise RuntimeError("speed.gpu_data: no training image could be encoded")
        # As ImageTextDataset.__getitem__ does: a failed item is replaced by the next good one.
        nxt, redirect = good[0], [0] * len(rows)
        for j in reversed(range(len(rows))):
            if filled is None or bool(filled[rows[j]]):
                nxt = j
            redirect[j] = nxt
        texts = [dataset.texts[redirect[j]] for j in range(len(rows))]
        distinct = list(dict.fromkeys(["", *texts]))
        ids = {c: i for i, c in enumerate(distinct)}
        device = module.device
        tokens = {k: v.to(device) for k, v in module._tokenize(distinct).items()}
        states = None
        if module.speed.cache_text:
            chunks = []
            context = module.trainer.precision_plugin.forward_context() if module._trainer else None
            with context or contextlib.nullcontext():
                for start in range(0, len(distinct), 256):
                    part = {k: v[start : start + 256] for k, v in tokens.items()}
                    chunks.append(module.text_forward(part))
            states = torch.cat(chunks)
        return cls(
            latents=module._latents.to(device),
            rows=torch.tensor([rows[redirect[j]] for j in range(len(rows))], device=device),
            captions=torch.tensor([ids[t] for t in texts], device=device),
            empty=ids[""],
            tokens=tokens,
            states=states,
        )

    def batch(
        self, module: LatentDiffusion, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | dict[str, torch.Tensor]]:
        """Latents (B, C, h, w) scaled, and the cached context (B, L, D) or the captions' tokens
        (B, L) for these sampler positions."""
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        positions = positions.to(self.rows.device, non_blocking=True)
        params = self.latents[self.rows[positions]]  # (B, 2·C, h, w)
        latents = DiagonalGaussianDistribution(params).sample() * module.vae.config.scaling_factor
        drop = torch.rand(len(positions)) < module.loss_cfg.caption_dropout  # as drop_captions draws it
        if drop.device != positions.device:
            drop = drop.pin_memory().to(positions.device, non_blocking=True)
        caption = torch.where(drop, self.empty, self.captions[positions])  # (B,)
        if self.states is not None:
            return latents, self.states[caption]
        return latents, {k: v[caption] for k, v in self.tokens.items()}
