"""The ×4 upscaler: ESRGAN's RRDBNet or Real-ESRGAN's compact SRVGG net, built, saved and loaded through spandrel.

Two architectures can be trained, each built as spandrel's own class so that what we train is
exactly what spandrel (and chaiNNer, ComfyUI, ...) loads back:

* :func:`build_rrdb` — ESRGAN's ``RRDBNet``; :func:`save_upscaler` writes the original ESRGAN
  ("old-arch") key names (``model.0.weight``, ``model.1.sub.0.RDB1.conv1.0.weight``, ...).
* :func:`build_compact` — Real-ESRGAN's ``SRVGGNetCompact`` (spandrel's ``Compact``; keys
  ``body.0.weight``, ``body.1.weight``, ...): a plain stack of 3×3 convs at input resolution and one
  pixel shuffle, whose output is *added to an upsampled copy of the input* — nearest-neighbour
  (Real-ESRGAN's, the default) or bicubic (``base="bicubic"``, :class:`~rapiddiff.models.upscaler_compact.CompactNet`):
  it learns only the residual over that copy, is a fraction of RRDB's size and fast on CPU.
  The base is recorded in the file's safetensors metadata (``"base"``); a file without it (every
  published Real-ESRGAN compact file, and ours from before the switch) loads nearest-based, exactly
  as spandrel runs it. A bicubic-based file loads in any spandrel tool, but only rapiddiff reads
  its base: elsewhere it runs nearest-based, which is not what it was trained for.

:func:`build_upscaler` picks one by name. :func:`load_upscaler` reads our files as well as
published ESRGAN, BasicSR and Real-ESRGAN (``{"params_ema": ...}``, e.g. ``realesr-general-x4v3``)
checkpoints.

Loading never unpickles code: ``.pth``/``.pt``/``.ckpt`` go through
:func:`rapiddiff.utils.io.load_weights` (``torch.load(weights_only=True)``), and only the
resulting state dict is handed to spandrel's ``ModelLoader().load_from_state_dict``.
(``ModelLoader().load_from_file`` would use spandrel's own restricted unpickler and also accepts
TorchScript archives; we keep one loading rule for the whole project instead.)
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rapiddiff.models.upscaler_names import ARCHITECTURES, COMPACT_BASES
from rapiddiff.utils.io import load_weights, save_safetensors
from rapiddiff.utils.logging import get_logger

if TYPE_CHECKING:
    import torch
    from torch import nn

log = get_logger(__name__)

UPSCALER_SUFFIXES = (".safetensors", ".pth", ".pt", ".ckpt", ".bin")
# The file name an ``upscaler/`` folder of a model folder holds (others are found by suffix).
UPSCALER_FILENAME = "upscaler.safetensors"


def build_rrdb(
    num_blocks: int = 23,
    num_feat: int = 64,
    num_grow_ch: int = 32,
    scale: int = 4,
    in_channels: int = 3,
    out_channels: int = 3,
) -> nn.Module:
    """ESRGAN's RRDBNet (spandrel's class): ``num_blocks`` RRDBs of width ``num_feat``, ×``scale``.

    The defaults are ESRGAN's and Real-ESRGAN x4plus's (23 blocks, 64 features, growth 32).
    """
    from spandrel.architectures.ESRGAN import ESRGAN

    if num_grow_ch != 32:
        # spandrel's RRDBNet fixes the dense-block growth at 32 (as every published ESRGAN does);
        # a different value could be trained but never loaded back through spandrel.
        raise ValueError(f"num_grow_ch={num_grow_ch}: spandrel's ESRGAN supports only 32")
    if scale not in (1, 2, 3, 4, 8, 16):
        raise ValueError(f"scale={scale}: ESRGAN supports 1, 2, 3, 4, 8 or 16")
    if num_blocks < 1 or num_feat < 1:
        raise ValueError(f"num_blocks={num_blocks}, num_feat={num_feat}: both must be ≥ 1")
    return ESRGAN(
        in_nc=in_channels,
        out_nc=out_channels,
        num_filters=num_feat,
        num_blocks=num_blocks,
        scale=scale,
    )


def build_compact(
    num_feat: int = 64,
    num_conv: int = 16,
    scale: int = 4,
    in_channels: int = 3,
    out_channels: int = 3,
    base: str = "nearest",
) -> nn.Module:
    """Real-ESRGAN's SRVGGNetCompact (spandrel's ``Compact``): ``num_conv`` 3×3 convs of width ``num_feat``.

    The defaults are ``realesr-animevideov3``'s (64 features, 16 convs; ``realesr-general-x4v3``
    uses 32 convs). Activations are PReLU, the only kind spandrel loads back (it rebuilds the net
    from the weights alone, and ReLU / LeakyReLU leave no weights to tell them apart).
    The returned module has ``scale`` and ``base`` attributes, like the loaded ones.

    ``base`` is the upsampled copy of the input the conv stack's output is added to: ``nearest``
    (Real-ESRGAN's; what spandrel's own class computes) or ``bicubic`` (the stack learns only what
    bicubic misses — on kshapes, where bicubic is already strong, a short run gains over it instead
    of first catching up with it).

    Initialisation (for training from scratch; a loaded file replaces it): PyTorch's default
    conv init shrinks the signal about 10× through the first layers of this plain conv stack, so the
    body starts nearly constant and learns slowly; He init for PReLU keeps it alive. With the nearest
    base the last conv is scaled by 0.1 so the network starts close to its skip (ESRGAN scales its
    residual blocks' init the same way); with the bicubic base it is zeroed, so step 0 *is* bicubic.
    """
    from rapiddiff.models.upscaler_compact import CompactNet  # deferred: it imports spandrel

    if base not in COMPACT_BASES:
        raise ValueError(f"base={base!r}: the compact upscaler's base is one of {', '.join(COMPACT_BASES)}")
    if num_feat < 1 or num_conv < 1:
        raise ValueError(f"num_feat={num_feat}, num_conv={num_conv}: both must be ≥ 1")
    if scale < 1:
        raise ValueError(f"scale={scale}: must be ≥ 1")
    if in_channels != out_channels:
        # spandrel infers (scale, out channels) from the last conv's width scale²·out, guessing
        # out = in first; other pairs may be read back with the wrong scale.
        raise ValueError(
            f"in_channels={in_channels}, out_channels={out_channels}: the compact net must keep "
            "the channel count for spandrel to load it back"
        )
    net = CompactNet(
        num_in_ch=in_channels,
        num_out_ch=out_channels,
        num_feat=num_feat,
        num_conv=num_conv,
        upscale=scale,
        base=base,
    )
    _init_compact(net, last_scale=0.0 if base == "bicubic" else 0.1)
    return net


def _init_compact(net: nn.Module, last_scale: float = 0.1) -> None:
    import torch
    from torch import nn

    convs = [m for m in net.body if isinstance(m, nn.Conv2d)]
    with torch.no_grad():
        for conv in convs:
            # PReLU starts at slope 0.25: He init with that leak keeps activations' variance.
            nn.init.kaiming_normal_(conv.weight, a=0.25, nonlinearity="leaky_relu")
            conv.bias.zero_()
        convs[-1].weight.mul_(last_scale)


def build_upscaler(arch: str = "rrdb", **kwargs: Any) -> nn.Module:
    """``build_rrdb(**kwargs)`` for ``arch="rrdb"``, ``build_compact(**kwargs)`` for ``"compact"``."""
    builders = {"rrdb": build_rrdb, "compact": build_compact}
    if arch not in builders:
        raise ValueError(f"unknown upscaler architecture {arch!r}; valid: {', '.join(ARCHITECTURES)}")
    return builders[arch](**kwargs)


def save_upscaler(module: nn.Module, path: str | Path) -> Path:
    """Write ``module``'s weights as safetensors under the key names spandrel detects; returns the path.

    (ESRGAN old-arch names for :func:`build_rrdb`, Real-ESRGAN's ``body.N`` for :func:`build_compact`.)

    A path without a ``.safetensors`` suffix is taken as a folder: ``path/upscaler.safetensors``.
    """
    from spandrel import MAIN_REGISTRY

    path = Path(path)
    if path.suffix != ".safetensors":
        path = path / UPSCALER_FILENAME
    state = dict(module.state_dict())
    # Refuse to write a file we could not load back: spandrel must recognise the keys.
    detected = [support.architecture.id for support in MAIN_REGISTRY if support.detect(state)]
    if not detected:
        raise ValueError(
            f"cannot save {type(module).__name__} as an upscaler: spandrel does not recognise its "
            "weights; build it with rapiddiff.models.upscaler.build_rrdb or build_compact"
        )
    scale = getattr(module, "scale", None)
    metadata = {"format": "pt", "architecture": detected[0], "scale": str(scale)}
    base = getattr(module, "base", None)
    if base is not None:  # the compact net's skip; a file without it is nearest-based
        metadata["base"] = str(base)
    save_safetensors(state, path, metadata=metadata)
    return path


def find_upscaler_file(path: str | Path) -> Path:
    """The weights file at ``path``: the file itself, or the single weights file in a folder."""
    path = Path(path)
    if path.is_file():
        return path
    if path.is_dir():
        preferred = path / UPSCALER_FILENAME
        if preferred.is_file():
            return preferred
        found = sorted(p for p in path.iterdir() if p.suffix in UPSCALER_SUFFIXES and p.is_file())
        if len(found) == 1:
            return found[0]
        if not found:
            raise FileNotFoundError(
                f"upscaler folder {path}: no weights file ({', '.join(UPSCALER_SUFFIXES)}) in it"
            )
        raise ValueError(
            f"upscaler folder {path}: several weights files ({', '.join(p.name for p in found)}); "
            f"name one, or keep only {UPSCALER_FILENAME}"
        )
    raise FileNotFoundError(f"upscaler weights not found: {path}")


def load_upscaler(path: str | Path, device: str | torch.device = "cpu") -> nn.Module:
    """Load an ESRGAN-family upscaler (or any architecture spandrel knows) in eval mode.

    Accepts safetensors and weights-only ``.pth`` files with old-arch ESRGAN keys, new BasicSR
    keys, or Real-ESRGAN's ``{"params_ema": ...}`` / ``{"params": ...}`` wrapping. A pickle that
    needs arbitrary code raises :class:`rapiddiff.utils.io.UnsafeCheckpointError`.
    The returned module has a ``scale`` attribute (its upscaling factor). A compact net comes back
    as :class:`~rapiddiff.models.upscaler_compact.CompactNet` with the ``base`` its safetensors
    metadata records (``nearest`` when none does: published files and ours from before the switch).
    """
    file = find_upscaler_file(path)
    base = _recorded_base(file)
    state = load_weights(file)
    state = _unwrap(state, file)
    try:
        descriptor = _load_own_compact(file, state) if base is not None else None
    except Exception as err:
        raise ValueError(f"{file}: could not build the upscaler from its weights ({err})") from err
    if descriptor is None:
        from spandrel import ModelLoader, UnsupportedModelError

        try:
            descriptor = ModelLoader().load_from_state_dict(state)
        except UnsupportedModelError as err:
            raise ValueError(
                f"{file}: not an upscaler architecture spandrel knows (ESRGAN, Real-ESRGAN, SwinIR, ...)"
            ) from err
        except Exception as err:
            raise ValueError(f"{file}: could not build the upscaler from its weights ({err})") from err
    module = descriptor.model
    if descriptor.architecture.id == "Compact":
        module = _as_compact_net(module, base or "nearest")
    elif base is not None:
        raise ValueError(
            f"{file}: metadata 'base'={base!r} is a compact-net setting, but the weights are "
            f"{descriptor.architecture.name}; remove the key or use a compact file"
        )
    if not hasattr(module, "scale"):
        module.scale = descriptor.scale
    module.eval().requires_grad_(False)
    return module.to(device)


def _load_own_compact(file: Path, state: dict[str, Any]) -> Any:
    """spandrel's descriptor of a compact net that rapiddiff saved (its metadata names the
    architecture Compact and records a base), built by spandrel's ``CompactArch`` itself; None for
    any other file (then ``ModelLoader`` detects the architecture).

    Why: ``import spandrel`` imports all of its ~40 architectures to build its registry (0.35 s of
    an idle cold ``rapiddiff generate``, 3 s at load 5) for the one class a rapiddiff file needs.
    The ``spandrel`` package's ``__init__`` is deferred (:mod:`rapiddiff.utils.imports`): it runs
    in place the first time anything asks the package for a name.
    """
    from safetensors import safe_open

    from rapiddiff.utils.imports import import_module

    with safe_open(str(file), "pt") as handle:
        if (handle.metadata() or {}).get("architecture") != "Compact":
            return None
    arch = import_module("spandrel.architectures.Compact", defer=("spandrel",)).CompactArch()
    return arch.load(state) if arch.detect(state) else None


def _recorded_base(file: Path) -> str | None:
    """The compact net's base recorded in a safetensors file's metadata (None: not recorded)."""
    if file.suffix != ".safetensors":
        return None  # torch pickles carry no metadata: published Real-ESRGAN .pth files are nearest
    from safetensors import safe_open

    try:
        with safe_open(str(file), "pt") as handle:
            base = (handle.metadata() or {}).get("base")
    except Exception:
        return None  # load_weights reports the broken file with its own message
    if base is not None and base not in COMPACT_BASES:
        raise ValueError(
            f"{file}: metadata 'base'={base!r} is not a compact-net base; valid: {', '.join(COMPACT_BASES)}"
        )
    return base


def _as_compact_net(module: nn.Module, base: str) -> nn.Module:
    """spandrel's loaded ``Compact`` as our CompactNet with ``base`` (the same weights, copied)."""
    from rapiddiff.models.upscaler_compact import CompactNet  # deferred: it imports spandrel

    net = CompactNet(
        num_in_ch=module.num_in_ch,
        num_out_ch=module.num_out_ch,
        num_feat=module.num_feat,
        num_conv=module.num_conv,
        upscale=module.upscale,
        base=base,
    )
    net.load_state_dict(module.state_dict())
    return net


def _unwrap(state: dict[str, Any], file: Path) -> dict[str, Any]:
    """Real-ESRGAN/BasicSR checkpoints wrap the weights: prefer the EMA copy, as they do."""
    import torch

    for key in ("params_ema", "params", "state_dict"):
        inner = state.get(key)
        if isinstance(inner, dict):
            state = inner
            break
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        raise ValueError(f"{file}: holds no tensors (keys: {', '.join(list(state)[:8])})")
    return tensors


def upscale(
    module: nn.Module,
    images: torch.Tensor,
    *,
    tile: int | None = None,
    tile_pad: int = 16,
) -> torch.Tensor:
    """Upscale ``images`` [B, 3, H, W] in [0, 1]; returns [B, 3, H·s, W·s] clamped to [0, 1].

    ``tile`` (pixels of input) processes the image in tiles of that size, each read with
    ``tile_pad`` pixels of context on every side and cropped back, so memory stays bounded on
    large images; with a pad at least the network's receptive field the result equals the
    whole-image one. ``None`` runs the whole image at once.
    """
    import torch

    param = next(module.parameters())
    scale = int(getattr(module, "scale", 4))
    x = images.to(device=param.device, dtype=param.dtype)
    with torch.inference_mode():
        if tile is None or (x.shape[-2] <= tile and x.shape[-1] <= tile):
            out = module(x)
        else:
            out = _tiled(module, x, scale, tile, tile_pad)
    return out.clamp(0, 1)


def _tiled(module: nn.Module, x: torch.Tensor, scale: int, tile: int, pad: int) -> torch.Tensor:
    # The same scheme as Real-ESRGAN's ``RealESRGANer.tile_process``: each tile is read with
    # context, upscaled, and only its own (unpadded) region is written to the output.
    b, c, h, w = x.shape
    out = x.new_zeros(b, c, h * scale, w * scale)
    for ty in range(math.ceil(h / tile)):
        for tx in range(math.ceil(w / tile)):
            y0, x0 = ty * tile, tx * tile
            y1, x1 = min(y0 + tile, h), min(x0 + tile, w)
            py0, px0 = max(y0 - pad, 0), max(x0 - pad, 0)
            py1, px1 = min(y1 + pad, h), min(x1 + pad, w)
            result = module(x[:, :, py0:py1, px0:px1])
            oy, ox = (y0 - py0) * scale, (x0 - px0) * scale
            out[:, :, y0 * scale : y1 * scale, x0 * scale : x1 * scale] = result[
                :, :, oy : oy + (y1 - y0) * scale, ox : ox + (x1 - x0) * scale
            ]
    return out
