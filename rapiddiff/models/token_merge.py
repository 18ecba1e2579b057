"""Token merging (ToMe for SD, Bolya & Hoffman 2023): fewer tokens in the high-resolution self-attention.

Opt-in and approximate (``token_merge=R``, ``rapiddiff generate --token-merge R``); never on by
default. In every transformer block of the U-Net's highest-resolution level that has self-attention,
``r = int(R × N)`` of the ``N`` tokens entering the self-attention are merged into similar ones
(bipartite soft matching), the attention runs on the ``N − r`` that are left, and its output is
copied back to all ``N`` positions before the residual add. Cross-attention and the feed-forward
see every token (tomesd's defaults: ``merge_attn`` only, ``sx = sy = 2``).

How and why: :class:`TokenMerge`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from rapiddiff.models.unet_hooks import UNetHooks

if TYPE_CHECKING:
    import torch
    from torch import nn

RATIO_MAX = 0.75  # 1 − 1/(sx·sy): at most every source token of each 2×2 cell is merged
SX = SY = 2
BUSY = "token merging: this U-Net is already in a merged run (runs cannot nest)"
PATTERN_SEED = 1_000_003  # destination patterns: evaluation i uses manual_seed(PATTERN_SEED + i)


def check_ratio(value: Any, where: str = "token_merge") -> float:
    """``token_merge`` as a float in [0, 0.75] (0 = off: the exact path)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not (0.0 <= float(value) <= RATIO_MAX):
        raise ValueError(
            f"{where} must be a number in [0, {RATIO_MAX}] (the fraction of the highest-resolution "
            f"self-attention's tokens merged; 0 = exact, 0.5 = ToMe's default), got {value!r}"
        )
    return float(value)


def destination_pattern(h: int, w: int, index: int) -> tuple[torch.Tensor, int]:
    """The token order of evaluation ``index`` on an h×w grid → (perm [N] int64: the destination
    tokens' flat indices, then the sources', each ascending; the number of destinations).

    One destination per full 2×2 cell, chosen by a CPU generator seeded ``PATTERN_SEED + index``;
    rows/columns past the last full cell are sources (as tomesd does)."""
    import torch

    hsy, wsx = h // SY, w // SX
    gen = torch.Generator().manual_seed(PATTERN_SEED + index)
    choice = torch.randint(SY * SX, (hsy, wsx, 1), generator=gen)
    cells = torch.zeros(hsy, wsx, SY * SX, dtype=torch.bool).scatter_(2, choice, True)
    grid = torch.zeros(h, w, dtype=torch.bool)
    grid[: hsy * SY, : wsx * SX] = cells.view(hsy, wsx, SY, SX).transpose(1, 2).reshape(hsy * SY, wsx * SX)
    flat = grid.reshape(-1)
    perm = torch.cat([flat.nonzero().flatten(), (~flat).nonzero().flatten()])
    return perm, hsy * wsx


def match(metric: torch.Tensor, perm: torch.Tensor, num_dst: int, r: int) -> tuple[torch.Tensor, ...]:
    """Bipartite soft matching of the tokens ``metric`` [B, N, C] → the merge plan (int64 tensors):
    ``(src_pos [S], dst_pos [D], unm [B, S−r], merged [B, r], dst_of [B, r], source_of [B, N])``.

    ``unm``/``merged``: positions in the source list kept / merged; ``dst_of``: each merged source's
    destination (a position in the destination list); ``source_of``: for each of the N tokens, its
    row in the merged sequence ``[unmerged sources, destinations]`` (what :func:`unmerge` gathers).
    """
    import torch

    batch, n, _ = metric.shape
    dst_pos, src_pos = perm[:num_dst], perm[num_dst:]
    s = n - num_dst
    unit = metric / metric.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    scores = unit.index_select(1, src_pos) @ unit.index_select(1, dst_pos).transpose(-1, -2)  # (B, S, D)
    node_max, node_idx = scores.max(dim=-1)  # (B, S): each source's most similar destination
    order = node_max.argsort(dim=-1, descending=True, stable=True)  # (B, S)
    unm, merged = order[:, r:], order[:, :r]
    dst_of = node_idx.gather(1, merged)  # (B, r)
    kept = s - r
    source_of = torch.empty(batch, n, dtype=torch.int64, device=metric.device)
    source_of[:, dst_pos] = kept + torch.arange(num_dst, device=metric.device)
    source_of.scatter_(1, src_pos[unm], torch.arange(kept, device=metric.device).expand(batch, kept))
    source_of.scatter_(1, src_pos[merged], kept + dst_of)
    return src_pos, dst_pos, unm, merged, dst_of, source_of


def merge(x: torch.Tensor, plan: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """[B, N, C] → [B, N − r, C]: the unmerged sources, then each destination averaged with the
    sources merged into it."""
    import torch

    src_pos, dst_pos, unm, merged, dst_of, _ = plan
    batch, _, c = x.shape
    src, dst = x.index_select(1, src_pos), x.index_select(1, dst_pos)
    kept = src.gather(1, unm[..., None].expand(batch, unm.shape[1], c))
    moved = src.gather(1, merged[..., None].expand(batch, merged.shape[1], c))
    dst = dst.scatter_reduce(1, dst_of[..., None].expand(batch, dst_of.shape[1], c), moved, reduce="mean")
    return torch.cat([kept, dst], dim=1)


def unmerge(y: torch.Tensor, plan: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """[B, N − r, C] → [B, N, C]: every token takes the row it was merged into."""
    source_of = plan[-1]
    return y.gather(1, source_of[..., None].expand(*source_of.shape, y.shape[-1]))


def merged_blocks(unet: nn.Module) -> tuple[list[nn.Module], int]:
    """The transformer blocks merged: those of the highest-resolution level that has self-attention
    (its down block and the mirroring up block), and that level (0 = the latent's own size).

    For SD 1.x and the kshapes model that is level 0, tomesd's ``max_downsample=1``; a U-Net whose
    first level has no attention (the tiny test preset, SDXL) merges at its first level that does.
    """
    names = ("down_blocks", "up_blocks")
    missing = [n for n in names if not hasattr(unet, n)]
    if missing:
        raise ValueError(
            f"token merging needs a diffusers UNet2DConditionModel-like U-Net (down_blocks, up_blocks); "
            f"{type(unet).__name__} lacks {', '.join(missing)}"
        )
    levels = len(unet.down_blocks)

    def blocks(block: nn.Module) -> list[nn.Module]:
        found = []
        for transformer in getattr(block, "attentions", None) or []:
            for tb in getattr(transformer, "transformer_blocks", []):
                attn = getattr(tb, "attn1", None)
                if attn is not None and not getattr(tb, "only_cross_attention", False):
                    found.append(tb)
        return found

    for level in range(levels):
        found = blocks(unet.down_blocks[level])
        if len(unet.up_blocks) == levels:
            found += blocks(unet.up_blocks[levels - 1 - level])
        if found:
            return found, level
    raise ValueError(
        f"token merging: {type(unet).__name__} has no self-attention transformer blocks in its down/up "
        "blocks, so there is nothing to merge"
    )


def level_grid(h: int, w: int, level: int) -> tuple[int, int]:
    """Token grid at ``level`` for an h×w latent (each downsampling halves, rounding up)."""
    for _ in range(level):
        h, w = math.ceil(h / 2), math.ceil(w / 2)
    return h, w


class TokenMerge(UNetHooks):
    """The token-merging controller of one U-Net; get it with :meth:`of` (one per U-Net).

    The matching is tomesd's ``bipartite_soft_matching_random2d``: the token grid is cut into 2×2
    cells, one token per cell is a *destination*, the rest are *sources*; each source finds its most
    similar destination (cosine similarity of the block's input tokens, tomesd's metric), and the
    ``r`` sources with the highest similarity are averaged into their destinations.

    Which destination in each cell: a fixed pattern per U-Net evaluation index ``i`` of a run, drawn
    once on the CPU from ``torch.Generator().manual_seed(PATTERN_SEED + i)`` and kept on the device.
    tomesd draws it with ``torch.randint`` on the device from a fork of the global RNG, once per call;
    a fixed per-evaluation pattern instead (1) keeps rapiddiff's seed rule — an image depends on its
    seed and settings only, never on the process's RNG state, its batch or the path; (2) is a
    constant a captured CUDA graph can hold (no RNG state, no host-to-device copy inside the loop);
    and (3) still moves the destinations from step to step, which is what ToMe's random choice is
    for (a fixed grid of destinations leaves grid artifacts). The matching itself is per row: each
    image (and each CFG half) merges by its own tokens, so a batch does not mix images.

    Why not PyPI's ``tomesd`` (0.1.3): it replaces each ``BasicTransformerBlock``'s class with a copy
    of an old diffusers ``forward`` (no ``pos_embed``, GLIGEN, ``ada_norm_single``/``continuous``);
    its destination draw forks the global RNG at first use (an image then depends on what ran
    before, not on its seed) and is switched off for odd batches (an image would depend on its
    batch size); and a draw from a non-default CUDA generator inside a captured graph is not
    replayable without registering it. The algorithm below is tomesd's (MIT), with the unmerge as
    one gather through a precomputed index instead of three scatters.

    How: like :mod:`rapiddiff.models.deep_cache`, no copy of diffusers' code. Two ``forward``
    wrappers per merged block are made once and installed only inside :meth:`TokenMerge.active`: the
    block's (it computes the matching from its input ``hidden_states``) and its ``attn1``'s (merge the
    input, attend, unmerge the output). ``R = 0`` installs nothing: the exact path, bit for bit.
    All shapes are fixed by ``N`` and ``R``; nothing reads a tensor back to the host.

    Determinism: bit for bit on the CPU. On CUDA the merge's ``scatter_reduce`` adds with atomics,
    whose order PyTorch does not fix: two runs may differ in the last bits of a merged token.
    """

    def __init__(self, unet: nn.Module) -> None:
        super().__init__()
        blocks, self.level = merged_blocks(unet)
        self.ratio = 0.0
        self.grid: tuple[int, int] = (0, 0)
        self.device: Any = None
        self.r = 0
        self.num_dst = 0
        self.perm: torch.Tensor | None = None  # this evaluation's destination pattern, on the device
        self._patterns: dict[tuple, torch.Tensor] = {}  # kept: a captured graph reads them
        for block in blocks:
            cell: list[Any] = [None]  # the block's merge plan, from its wrapper to its attn1's
            self._wrapped.append((block, self._block_wrapper(block, cell)))
            self._wrapped.append((block.attn1, self._attn_wrapper(block.attn1, cell)))

    def _block_wrapper(self, module: nn.Module, cell: list[Any]) -> Callable[..., Any]:
        inner = module.forward

        def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.perm is None or self.r <= 0:
                return inner(hidden_states, *args, **kwargs)
            n = hidden_states.shape[1]
            if n != self.grid[0] * self.grid[1]:
                raise ValueError(
                    f"token merging: a level-{self.level} transformer block got {n} tokens, expected "
                    f"{self.grid[0]}×{self.grid[1]} for this latent size"
                )
            cell[0] = match(hidden_states, self.perm, self.num_dst, self.r)
            out = inner(hidden_states, *args, **kwargs)
            cell[0] = None
            return out

        return forward

    def _attn_wrapper(self, module: nn.Module, cell: list[Any]) -> Callable[..., Any]:
        inner = module.forward

        def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            plan = cell[0]
            plain = args or kwargs.get("encoder_hidden_states") is not None
            if plan is None or plain or kwargs.get("attention_mask") is not None:
                return inner(hidden_states, *args, **kwargs)  # a masked or cross call: not merged
            return unmerge(inner(merge(hidden_states, plan), **kwargs), plan)

        return forward

    def attention_shapes(self, size: tuple[int, int], ratio: float) -> set[tuple[int, int, int, int]]:
        """(query tokens, key tokens, heads, head width) of the merged self-attentions on ``size``
        latents: the shapes the fast path's per-shape backend choice must also time."""
        h, w = level_grid(int(size[0]), int(size[1]), self.level)
        n = h * w
        tokens = n - min(int(n * check_ratio(ratio)), n - (h // SY) * (w // SX))
        shapes = set()
        for module, _ in self._wrapped[1::2]:  # the attn1 modules
            inner = module.to_q.out_features
            shapes.add((tokens, tokens, module.heads, inner // module.heads))
        return shapes

    def pattern(self, index: int) -> torch.Tensor:
        """Evaluation ``index``'s destination pattern on this run's grid and device (made once, kept)."""
        h, w = self.grid
        key = (h, w, str(self.device), index)
        if key not in self._patterns:
            perm, _ = destination_pattern(h, w, index)
            self._patterns[key] = perm.to(self.device)
        return self._patterns[key]

    def begin(self, index: int) -> None:
        """Before U-Net evaluation ``index`` of a run: that evaluation's destination pattern."""
        self.perm = self.pattern(index) if self.r > 0 else None

    @contextlib.contextmanager
    def active(self, ratio: float, size: tuple[int, int], device: Any) -> Iterator[Callable[[int], None]]:
        """Install the wrappers for one sampling run on ``size`` (h, w) latents on ``device``;
        yields ``step(i)`` to call before evaluation i."""
        check_ratio(ratio)
        if self._installed:  # before the run's settings change
            raise RuntimeError(BUSY)
        h, w = level_grid(int(size[0]), int(size[1]), self.level)
        n = h * w
        self.ratio, self.grid, self.device = ratio, (h, w), device
        self.num_dst = (h // SY) * (w // SX)
        self.r = min(int(n * ratio), n - self.num_dst)
        with self.installed(BUSY):
            self.perm = None
            try:
                yield self.begin
            finally:
                self.perm = None

    def stepped(self, fn: Callable[..., Any], evaluations: int) -> Callable[..., Any]:
        """``fn`` with :meth:`begin` before each call (:meth:`UNetHooks.counted`; a graph
        capture's warm-up makes every pattern before it records)."""
        return self.counted(fn, evaluations, self.begin)


__all__ = [
    "RATIO_MAX",
    "TokenMerge",
    "check_ratio",
    "destination_pattern",
    "match",
    "merge",
    "merged_blocks",
    "unmerge",
]
