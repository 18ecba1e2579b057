"""DeepCache (Ma, Fang & Wang, CVPR 2024): reuse the U-Net's deep features across denoising steps.

How and why: :class:`DeepCache`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from rapiddiff.models.unet_hooks import UNetHooks

if TYPE_CHECKING:
    from torch import nn

FULL, REPLAY = "full", "replay"


def check_interval(value: Any, where: str = "deep_cache") -> int:
    """``deep_cache`` as an int ≥ 1 (1 = off: every step runs the whole U-Net)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{where} must be an integer ≥ 1 (the full U-Net runs every N steps; 1 = exact), got {value!r}"
        )
    return value


def full_steps(evaluations: int, interval: int) -> list[int]:
    """Indices of the U-Net evaluations that run the whole U-Net: 0, N, 2N, … (ceil(n/N) of them)."""
    return list(range(0, evaluations, interval))


class DeepCache(UNetHooks):
    """The cache controller of one U-Net; get it with :meth:`of` (one per U-Net).

    Opt-in and approximate (``deep_cache=N``, ``rapiddiff generate --deep-cache N``); never on by
    default. Neighbouring steps of a sampler change the U-Net's deep, low-resolution features little,
    so every ``N`` steps (uniform interval, the paper's main setting) the whole U-Net runs and the
    features the shallow end of the last up block takes from the deep path are kept; the steps in
    between run only the shallow branch: ``conv_in``, the first layer of the first down block, the
    up-block layers that consume that layer's (and ``conv_in``'s) skip states, and ``conv_out``. The
    branch is the paper's SD 1.5 setting (``cache_layer_id=0, cache_block_id=0`` in
    horseee/DeepCache's experiment code): the first down block's layer 0.

    How: no copy of diffusers' ``UNet2DConditionModel.forward``. Every *deep* module (the rest of
    the first down block, the deeper down blocks, the mid block, all up blocks but the last, and the
    last up block's layers that read only deep inputs) has its ``forward`` wrapped while a cached run
    is active: on a full step the wrapper runs the module and keeps its output; on a cached step it
    returns the kept output without computing. diffusers' own forward then wires everything as
    usual, so the fresh shallow layers see the cached deep feature exactly where the full pass
    would have given them the fresh one (the approach of the ``DeepCacheSDHelper`` extension, whose
    skip rule this follows, with the branch of the paper's experiments).

    A full step is a full evaluation: ``N = 1`` is the exact U-Net, bit for bit. The wrappers are
    made once per U-Net and installed only inside :meth:`DeepCache.active`, so the exact path never
    runs through them (and ``torch.compile`` sees one stable function object per module).
    """

    def __init__(self, unet: nn.Module, layer: int = 0) -> None:
        super().__init__()
        self.mode = FULL
        self.store: dict[int, Any] = {}
        self.full_evaluations = 0  # counters over the controller's life (tests, benchmarks)
        self.cached_evaluations = 0
        self._wrapped = [
            (module, self._wrapper(key, module)) for key, module in enumerate(deep_modules(unet, layer))
        ]

    def _wrapper(self, key: int, module: nn.Module) -> Callable[..., Any]:
        inner = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            if self.mode == REPLAY:
                return self.store[key]
            out = inner(*args, **kwargs)
            self.store[key] = out
            return out

        return forward

    def begin(self, index: int, interval: int) -> None:
        """Before U-Net evaluation ``index`` of a run: full on 0, N, 2N, …, cached in between."""
        if index % interval == 0:
            self.mode = FULL
            self.full_evaluations += 1
        else:
            if not self.store:
                raise RuntimeError("DeepCache: a cached step came before any full step of this run")
            self.mode = REPLAY
            self.cached_evaluations += 1

    @contextlib.contextmanager
    def active(self, interval: int) -> Iterator[Callable[[int], None]]:
        """Install the wrappers for one sampling run; yields ``step(i)`` to call before evaluation i."""
        check_interval(interval)
        with self.installed("DeepCache: this U-Net is already in a cached run (runs cannot nest)"):
            self.mode = FULL
            try:
                yield lambda index: self.begin(index, interval)
            finally:
                self.mode = FULL
                self.store.clear()

    def stepped(self, fn: Callable[..., Any], interval: int, evaluations: int) -> Callable[..., Any]:
        """``fn`` with :meth:`begin` before each call (:meth:`UNetHooks.counted`)."""
        return self.counted(fn, evaluations, lambda index: self.begin(index, interval))


def deep_modules(unet: nn.Module, layer: int = 0) -> list[nn.Module]:
    """The modules a cached step skips, for the branch at the first down block's ``layer``.

    The skip states run down → up in reverse: the last up block (n + 1 layers) reads, from its
    first layer to its last, the first down block's layer outputs n−1 … 0 and then ``conv_in``'s
    output. So with down layers 0..``layer`` fresh, the last up block's layers from
    ``n − 1 − layer`` on are fresh and the ones before are deep.
    """
    names = ("down_blocks", "up_blocks", "conv_in", "conv_out")
    missing = [n for n in names if not hasattr(unet, n)]
    if missing:
        raise ValueError(
            f"DeepCache needs a diffusers UNet2DConditionModel-like U-Net (down_blocks, up_blocks, conv_in, "
            f"conv_out); {type(unet).__name__} lacks {', '.join(missing)}"
        )
    first, last = unet.down_blocks[0], unet.up_blocks[-1]
    n = len(first.resnets)
    if len(last.resnets) != n + 1:
        raise ValueError(
            f"DeepCache: the last up block has {len(last.resnets)} layers, the first down block {n}; "
            f"expected {n + 1} (a standard SD U-Net), so the shallow branch is not defined here"
        )
    if not 0 <= layer < n:
        raise ValueError(
            f"DeepCache: layer must be in 0..{n - 1} (the first down block's layers), got {layer}"
        )

    def layers(block: nn.Module, sl: slice) -> list[nn.Module]:
        found = list(block.resnets[sl])
        if getattr(block, "attentions", None) is not None:
            found += list(block.attentions[sl])
        return found

    deep = layers(first, slice(layer + 1, None))
    deep += list(first.downsamplers or [])
    deep += list(unet.down_blocks[1:])
    deep += [unet.mid_block] if getattr(unet, "mid_block", None) is not None else []
    deep += list(unet.up_blocks[:-1])
    deep += layers(last, slice(0, n - 1 - layer))
    return deep


__all__ = ["DeepCache", "check_interval", "deep_modules", "full_steps"]
