"""A small PatchGAN critic and hinge losses, shared by the VAE and upscaler stages.

Both players update in one optimizer step (simultaneous gradient descent): the critic's loss
sees the generator's output detached, and the generator's adversarial term goes through the
critic with its parameters detached (``torch.func.functional_call``), so each loss moves only
its own player. One backward, one optimizer, and Lightning's automatic optimization (gradient
accumulation, mixed precision, DDP) works unchanged — the alternating two-optimizer loop of
taming-transformers would need manual optimization for the same result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GanConfig:
    """Adversarial training (off when ``weight`` is 0)."""

    weight: float = 0.0
    """Weight of the generator's adversarial term; 0 = no critic (0.1 for ESRGAN-style, 0.5 for LDM VAEs)."""
    start_step: int = 0
    """Train without the adversarial term until this optimizer step (reconstruction first)."""
    channels: int = 64
    """Width of the critic's first layer."""
    layers: int = 3
    """Strided conv layers: 3 gives a 70×70 receptive field (pix2pix)."""
    lr_scale: float = 1.0
    """Critic learning rate = this × the model's."""

    def __post_init__(self) -> None:
        if self.weight < 0:
            raise ValueError(f"gan.weight must be >= 0, got {self.weight}")


class PatchDiscriminator(nn.Module):
    """pix2pix's N-layer PatchGAN: one real/fake score per patch, [B, 1, h, w].

    GroupNorm instead of BatchNorm: no running statistics, so calling it with detached
    parameters (functional_call) changes no state.
    """

    def __init__(self, in_channels: int = 3, channels: int = 64, layers: int = 3) -> None:
        super().__init__()
        blocks: list[nn.Module] = [nn.Conv2d(in_channels, channels, 4, 2, 1), nn.LeakyReLU(0.2)]
        width = channels
        for i in range(1, layers + 1):
            out = channels * min(2**i, 8)
            stride = 2 if i < layers else 1
            blocks += [
                nn.Conv2d(width, out, 4, stride, 1),
                nn.GroupNorm(min(32, out // 4), out),
                nn.LeakyReLU(0.2),
            ]
            width = out
        blocks.append(nn.Conv2d(width, 1, 4, 1, 1))
        self.net = nn.Sequential(*blocks)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)  # (B, 1, h, w)


def adversarial_losses(
    critic: PatchDiscriminator, real: torch.Tensor, fake: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(generator term, critic hinge loss); each moves only its own player (see module doc)."""
    frozen = {name: p.detach() for name, p in critic.named_parameters()}
    generator_term = -torch.func.functional_call(critic, frozen, (fake,)).mean()
    critic_loss = 0.5 * (F.relu(1 - critic(real)).mean() + F.relu(1 + critic(fake.detach())).mean())
    return generator_term, critic_loss
