"""fp8 (e4m3) linear layers through ``torch._scaled_mm``, for Hopper-class GPUs.

Weights are quantised once with one scale per tensor; activations are quantised on the fly
(per-tensor amax, computed on the GPU: no host synchronisation, so it stays graph-capturable).
Under ``torch.compile`` the amax/scale/cast prologue fuses into the neighbouring kernels. This
costs accuracy: the benchmark reports the PSNR of fp8 images against fp16 ones separately.
Written here rather than through torchao because the GPU image does not carry torchao and the
whole method is these few lines.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

E4M3_MAX = 448.0


class Fp8Linear(nn.Module):
    """A drop-in for ``nn.Linear`` with e4m3 weights and dynamically quantised e4m3 inputs."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        scale = weight.abs().amax().float().clamp_min(1e-12) / E4M3_MAX
        self.register_buffer("weight_fp8", (weight.float() / scale).to(torch.float8_e4m3fn).contiguous())
        self.register_buffer("weight_scale", scale.reshape(()))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        rows = x2.shape[0]
        pad = (-rows) % 16  # _scaled_mm wants every dimension a multiple of 16
        if pad:
            x2 = F.pad(x2, (0, 0, 0, pad))
        x_scale = x2.abs().amax().float().clamp_min(1e-12) / E4M3_MAX
        xq = (x2.float() / x_scale).to(torch.float8_e4m3fn).contiguous()
        out = torch._scaled_mm(
            xq, self.weight_fp8.t(), scale_a=x_scale, scale_b=self.weight_scale, out_dtype=x.dtype
        )
        if pad:
            out = out[:rows]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)


def fp8_supported(device: torch.device) -> tuple[bool, str]:
    """Whether fp8 matrix products run here, and if not why."""
    if device.type != "cuda":
        return False, f"fp8 matrix products need a CUDA GPU (device is {device.type})"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return False, f"fp8 needs compute capability ≥ 8.9 (Ada/Hopper); this GPU is {major}.{minor}"
    return True, ""


def quantize_linears(model: nn.Module, where: str = "transformer_blocks") -> int:
    """Replace the ``nn.Linear`` layers under modules whose path contains ``where``; returns how many.

    Layers whose widths are not multiples of 16 (a ``_scaled_mm`` requirement) stay as they are.
    """
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and where in name
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    ]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Fp8Linear(module))
    return len(targets)
