"""The emoji-zh judge: an image classifier trained only on real emoji artwork, then frozen.

It learns every entity of a data folder (``entities.jsonl``) from ``glyphs/<style>/<id>.png``
composed onto augmented canvases (:mod:`rapiddiff.eval.judge_augment`), before any generator is
trained, so the ruler never learns from what it measures. It is scored on test renders drawn from
a generator seed training never uses. Saved as ``model.safetensors`` + ``judge.json`` (classes,
each class's subcategory, input size, normalisation, training figures); loading never unpickles.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rapiddiff.eval.common import read_jsonl, write_json
from rapiddiff.eval.judge_augment import Augment, render
from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)

WEIGHTS, CONFIG = "model.safetensors", "judge.json"
TEST_SEED_OFFSET = 1_000_003
"""Test renders are drawn from generator seed ``seed + TEST_SEED_OFFSET``; training uses ``seed``."""
ARCHS: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "resnet18": ((64, 128, 256, 512), (2, 2, 2, 2)),
    "small": ((32, 64, 128, 256), (2, 2, 2, 2)),
    "tiny": ((8, 16, 32, 64), (1, 1, 1, 1)),
}
"""Preset → (widths, blocks per stage) of the ResNet (torchvision's BasicBlock)."""


@dataclass
class JudgeConfig:
    """Everything needed to rebuild and use a saved judge (``judge.json``)."""

    classes: list[str]
    """Entity ids, in logit order."""
    subcategories: list[str]
    """Each class's subcategory (same order)."""
    styles: list[str]
    """The artwork styles the judge was trained on."""
    arch: str = "resnet18"
    input_size: int = 64
    """Images are resized (antialiased bilinear) to input_size² before the network."""
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    figures: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"unknown judge arch {self.arch!r}; choose from {', '.join(ARCHS)}")
        if len(self.classes) != len(self.subcategories):
            raise ValueError(f"{len(self.classes)} classes but {len(self.subcategories)} subcategories")


class JudgeNet(nn.Module):
    """A ResNet of torchvision BasicBlocks with a stride-2 3×3 stem and no max-pool: small emoji
    keep 4× more resolution into the first stage than ImageNet's 7×7 + pool stem leaves them."""

    def __init__(self, num_classes: int, arch: str = "resnet18") -> None:
        from torchvision.models.resnet import BasicBlock

        super().__init__()
        widths, depths = ARCHS[arch]
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(inplace=True),
        )
        stages, width = [], widths[0]
        for i, (out, depth) in enumerate(zip(widths, depths, strict=True)):
            stride = 1 if i == 0 else 2
            down = None
            if stride != 1 or width != out:
                down = nn.Sequential(nn.Conv2d(width, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))
            blocks = [BasicBlock(width, out, stride, down)] + [BasicBlock(out, out) for _ in range(depth - 1)]
            stages.append(nn.Sequential(*blocks))
            width = out
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(width, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Penultimate features (B, widths[-1]): the pooled last stage."""
        return self.stages(self.stem(x)).mean((2, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))  # (B, classes)


def prepare(images: torch.Tensor, config: JudgeConfig, device: torch.device) -> torch.Tensor:
    """Images in [0, 1] (B, 3, H, W) → the network's input: resized (antialiased bilinear), normalised."""
    size = config.input_size
    x = images.to(device, torch.float32)
    if x.shape[-2:] != (size, size):
        x = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    mean = torch.tensor(config.mean, device=device).view(1, 3, 1, 1)
    std = torch.tensor(config.std, device=device).view(1, 3, 1, 1)
    return (x - mean) / std


class Judge:
    """A frozen judge: :meth:`logits` and :meth:`features` of images in [0, 1] (B, 3, H, W)."""

    def __init__(self, net: JudgeNet, config: JudgeConfig, device: torch.device | str = "cpu") -> None:
        self.net, self.config, self.device = net.eval().to(device), config, torch.device(device)
        self.subcategory_of = dict(zip(config.classes, config.subcategories, strict=True))

    def prepare(self, images: torch.Tensor) -> torch.Tensor:
        return prepare(images, self.config, self.device)

    @torch.inference_mode()
    def logits(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(self.prepare(images)).float()

    @torch.inference_mode()
    def features(self, images: torch.Tensor) -> torch.Tensor:
        return self.net.features(self.prepare(images)).float()

    @torch.inference_mode()
    def read(self, images: torch.Tensor, k: int = 5) -> tuple[list[list[str]], torch.Tensor]:
        """The top-``k`` entity ids of each image, and its penultimate features."""
        feats = self.net.features(self.prepare(images))
        top = self.net.head(feats).float().topk(min(k, len(self.config.classes)), dim=1).indices.cpu()
        return [[self.config.classes[i] for i in row] for row in top.tolist()], feats.float().cpu()


def save_judge(folder: str | Path, net: JudgeNet, config: JudgeConfig) -> Path:
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()}
    save_file(state, str(folder / WEIGHTS), metadata={"format": "pt", "arch": config.arch})
    write_json(folder / CONFIG, asdict(config))
    return folder


def load_judge(folder: str | Path, device: torch.device | str = "cpu") -> Judge:
    """The judge saved in ``folder``: safetensors only (a pickle would run code, and is refused)."""
    from safetensors.torch import load_file

    from rapiddiff.models.weights import PICKLE_FIX
    from rapiddiff.utils.io import UnsafeCheckpointError

    folder = Path(folder)
    if not (folder / CONFIG).is_file():
        raise FileNotFoundError(
            f"{folder}: no {CONFIG}; a judge folder is written by `rapiddiff eval judge-train`"
        )
    shards = weight_files(folder)
    if not shards:
        pickles = sorted(
            p.name for p in folder.iterdir() if p.suffix in (".pt", ".pth", ".bin", ".ckpt", ".pkl")
        )
        if pickles:
            raise UnsafeCheckpointError(
                f"{folder}: the judge's weights must be {WEIGHTS}; {', '.join(pickles)} would be unpickled, "
                f"which is refused. {PICKLE_FIX}"
            )
        raise FileNotFoundError(f"{folder}: no {WEIGHTS} (nor its shards)")
    raw = json.loads((folder / CONFIG).read_text(encoding="utf-8"))
    known = JudgeConfig.__dataclass_fields__
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ValueError(f"{folder / CONFIG}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(known)}")
    config = JudgeConfig(**{k: tuple(v) if k in ("mean", "std") else v for k, v in raw.items()})
    net = JudgeNet(len(config.classes), config.arch)
    state: dict[str, torch.Tensor] = {}
    for shard in shards:  # weights stored as float16 (half the size) come back as float32
        state.update({k: v.float() if v.is_floating_point() else v for k, v in load_file(str(shard)).items()})
    net.load_state_dict(state)
    return Judge(net, config, device)


def weight_files(folder: Path) -> list[Path]:
    """The judge's weights: ``model.safetensors``, or its shards ``model-0000K-of-0000N.safetensors``
    (a shipped judge is split so that each file stays small), all N of them."""
    if (folder / WEIGHTS).is_file():
        return [folder / WEIGHTS]
    shards = sorted(folder.glob("model-*-of-*.safetensors"))
    if shards:
        total = int(shards[0].stem.rsplit("-of-", 1)[1])
        if len(shards) != total:
            raise FileNotFoundError(f"{folder}: {len(shards)} of the judge's {total} weight shards are here")
    return shards


def shard_judge(folder: str | Path, parts: int = 2) -> list[Path]:
    """Rewrite a judge's ``model.safetensors`` as ``parts`` float16 shards (for shipping: the
    frozen judge's float16 weights give the same verdicts at half the bytes)."""
    from safetensors.torch import load_file, save_file

    folder = Path(folder)
    state = {k: v.half() if v.is_floating_point() else v for k, v in load_file(str(folder / WEIGHTS)).items()}
    sizes = {k: v.numel() * v.element_size() for k, v in state.items()}
    total, done, groups = sum(sizes.values()), 0, [{} for _ in range(parts)]
    for key, tensor in state.items():
        groups[min(parts - 1, int(done * parts / total))][key] = tensor
        done += sizes[key]
    paths = [folder / f"model-{i + 1:05d}-of-{parts:05d}.safetensors" for i in range(parts)]
    for path, group in zip(paths, groups, strict=True):
        save_file(group, str(path), metadata={"format": "pt"})
    (folder / WEIGHTS).unlink()
    return paths


# --- the data folder's artwork -------------------------------------------------------------------


def read_entities(data_dir: str | Path) -> list[dict[str, Any]]:
    """``entities.jsonl``, every record checked for ``id`` and ``subcategory``."""
    path = Path(data_dir) / "entities.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: --data must be a folder written by `rapiddiff data emoji`"
        )
    rows = read_jsonl(path)
    for number, row in enumerate(rows, start=1):
        missing = [k for k in ("id", "subcategory") if not row.get(k)]
        if missing:
            raise ValueError(f"{path}: record {number} lacks {', '.join(missing)}")
    if not rows:
        raise ValueError(f"{path}: no entities")
    return rows


@dataclass
class Glyphs:
    """Every readable glyph of the folder: RGBA [G, 4, S, S] in [0, 1], its class and style index."""

    pixels: torch.Tensor
    labels: torch.Tensor
    style: torch.Tensor
    styles: list[str]
    skipped: list[str]

    def select(self, keep: torch.Tensor) -> Glyphs:
        return Glyphs(self.pixels[keep], self.labels[keep], self.style[keep], self.styles, self.skipped)


def load_glyphs(
    data_dir: str | Path, classes: list[str], styles: list[str] | None = None, size: int = 64
) -> Glyphs:
    """``glyphs/<style>/<id>.png`` of every class and style (all styles found when None), resized to
    ``size``²; a missing or unreadable file is skipped, counted and named in a warning."""
    import numpy as np
    from PIL import Image

    root = Path(data_dir) / "glyphs"
    if styles is None:
        styles = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    if not styles:
        raise FileNotFoundError(f"{root}: no style folders (glyphs/<style>/<id>.png)")
    pixels, labels, style_of, skipped = [], [], [], []
    for s, style in enumerate(styles):
        for c, entity in enumerate(classes):
            path = root / style / f"{entity}.png"
            try:
                with Image.open(path) as image:
                    rgba = image.convert("RGBA")
            except (OSError, SyntaxError) as err:
                skipped.append(f"{path} ({type(err).__name__})")
                continue
            if rgba.size != (size, size):
                rgba = rgba.resize((size, size), Image.Resampling.LANCZOS)
            pixels.append(torch.from_numpy(np.array(rgba)).permute(2, 0, 1))
            labels.append(c)
            style_of.append(s)
    if skipped:
        log.warning("%d glyph file(s) missing or unreadable, skipped: %s%s", len(skipped), ", ".join(skipped[:5]),
                    " ..." if len(skipped) > 5 else "")  # fmt: skip
    if not pixels:
        raise FileNotFoundError(f"{root}: no readable glyph for any entity in styles {', '.join(styles)}")
    return Glyphs(
        torch.stack(pixels).float() / 255, torch.tensor(labels), torch.tensor(style_of), styles, skipped
    )


# --- training and testing ------------------------------------------------------------------------


@dataclass
class TrainSettings:
    """How long and how the judge trains (``rapiddiff eval judge-train``'s flags)."""

    epochs: float = 40.0
    """One epoch: as many renders as there are training glyphs."""
    minutes: float | None = None
    """A time budget instead of epochs (the LR follows elapsed time)."""
    batch_size: int = 256
    lr: float = 2e-3
    weight_decay: float = 0.05
    label_smoothing: float = 0.1
    warmup: float = 0.03
    seed: int = 0
    test_renders: int = 4
    """Test renders per glyph."""


def _lr_factor(progress: float, warmup: float) -> float:
    if progress < warmup:
        return progress / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - warmup) / (1 - warmup))))


def fit(
    net: JudgeNet,
    glyphs: Glyphs,
    shades: torch.Tensor,
    config: JudgeConfig,
    settings: TrainSettings,
    device: torch.device,
) -> dict[str, Any]:
    """Train ``net`` on renders of ``glyphs`` (AdamW, warm-up + cosine, label smoothing); returns
    the training figures (steps, images, seconds, images/s after the first 10 steps)."""
    cuda = device.type == "cuda"
    net.to(device).train()
    if cuda:
        net.to(memory_format=torch.channels_last)
    pixels, labels = glyphs.pixels.to(device), glyphs.labels.to(device)
    shades = shades.to(device)
    gen = torch.Generator(device).manual_seed(settings.seed)
    optimiser = torch.optim.AdamW(net.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    total = max(1, math.ceil(settings.epochs * len(labels) / settings.batch_size))
    step, started, timed_from, losses = 0, time.perf_counter(), None, []
    while True:
        elapsed = time.perf_counter() - started
        progress = elapsed / (60 * settings.minutes) if settings.minutes else step / total
        if progress >= 1:
            break
        for group in optimiser.param_groups:
            group["lr"] = settings.lr * _lr_factor(progress, settings.warmup)
        index = torch.randint(len(labels), (settings.batch_size,), generator=gen, device=device)
        x = prepare(render(pixels[index], config.input_size, shades, Augment(), gen), config, device)
        if cuda:
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = F.cross_entropy(net(x), labels[index], label_smoothing=settings.label_smoothing)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
        step += 1
        if step == 10:
            if cuda:
                torch.cuda.synchronize()
            timed_from = time.perf_counter()
        if step % 50 == 0 or step == 1:
            losses.append([step, round(float(loss.detach()), 4)])
            log.info("judge step %d: loss %.4f, lr %.2e", step, float(loss), optimiser.param_groups[0]["lr"])
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    timed = time.perf_counter() - timed_from if timed_from is not None else None
    net.eval()
    return {
        "steps": step,
        "images": step * settings.batch_size,
        "seconds": round(seconds, 2),
        "images_per_second": round((step - 10) * settings.batch_size / timed, 1) if timed else None,
        "losses": losses,
        "device": str(device),
    }


def test(
    judge: Judge, glyphs: Glyphs, shades: torch.Tensor, *, seed: int, renders: int, batch: int = 512
) -> dict[str, Any]:
    """Top-1 / top-5 / subcategory accuracy (%) of ``judge`` on ``renders`` augmented renders of
    every glyph drawn from generator seed ``seed``, overall and per style."""
    device = judge.device
    gen = torch.Generator(device).manual_seed(seed)
    pixels, shades = glyphs.pixels.to(device), shades.to(device)
    subcategory = {name: i for i, name in enumerate(dict.fromkeys(judge.config.subcategories))}
    sub = torch.tensor([subcategory[s] for s in judge.config.subcategories])
    top1, top5, sub_ok = [], [], []
    for _ in range(renders):
        for start in range(0, len(glyphs.labels), batch):
            index = torch.arange(start, min(start + batch, len(glyphs.labels)))
            images = render(pixels[index.to(device)], judge.config.input_size, shades, Augment(), gen)
            top = judge.logits(images).topk(min(5, len(sub)), dim=1).indices.cpu()
            truth = glyphs.labels[index]
            top1.append(top[:, 0] == truth)
            top5.append((top == truth[:, None]).any(1))
            sub_ok.append(sub[top[:, 0]] == sub[truth])
    hits = {"top1": torch.cat(top1), "top5": torch.cat(top5), "subcategory": torch.cat(sub_ok)}
    styles = glyphs.style.repeat(renders)

    def percent(keep: torch.Tensor) -> dict[str, float]:
        n = int(keep.sum())
        return {k: round(100.0 * float(v[keep].float().mean()), 2) for k, v in hits.items()} | {"images": n}

    return {
        "all": percent(torch.ones_like(styles, dtype=torch.bool)),
        "by_style": {glyphs.styles[s]: percent(styles == s) for s in sorted(set(styles.tolist()))},
        "seed": seed,
        "renders_per_glyph": renders,
    }


def train_judge(
    data_dir: str | Path,
    out: str | Path,
    settings: TrainSettings,
    *,
    arch: str = "resnet18",
    input_size: int = 64,
    device: str = "auto",
    leave_out_style: str | None = None,
) -> dict[str, Any]:
    """Train a judge on the folder's artwork (without ``leave_out_style``), test it, save it to ``out``
    with its figures (also ``out/figures.json``); returns the figures."""
    from rapiddiff.eval.emoji_layout import calibrate
    from rapiddiff.utils.device import resolve_device

    dev = resolve_device(device)
    entities = read_entities(data_dir)
    classes = [e["id"] for e in entities]
    glyphs = load_glyphs(data_dir, classes)
    if leave_out_style is not None and leave_out_style not in glyphs.styles:
        raise ValueError(
            f"--leave-out-style {leave_out_style!r}: the folder's styles are {', '.join(glyphs.styles)}"
        )
    held = glyphs.style == (glyphs.styles.index(leave_out_style) if leave_out_style else -1)
    train = glyphs.select(~held)
    vocab = calibrate(data_dir)
    shades = torch.from_numpy(vocab.shades())
    config = JudgeConfig(
        classes=classes,
        subcategories=[e["subcategory"] for e in entities],
        styles=[s for s in glyphs.styles if s != leave_out_style],
        arch=arch,
        input_size=input_size,
    )
    torch.manual_seed(settings.seed)
    net = JudgeNet(len(classes), arch)
    log.info("judge: %d classes, %d training glyphs (%s), %s at %d², on %s", len(classes), len(train.labels),
             ", ".join(config.styles), arch, input_size, dev)  # fmt: skip
    training = fit(net, train, shades, config, settings, dev)
    judge = Judge(net, config, dev)
    seed = settings.seed + TEST_SEED_OFFSET
    figures = {
        "training": training,
        "settings": asdict(settings),
        "glyphs": {
            "train": len(train.labels),
            "skipped": glyphs.skipped[:20],
            "skipped_count": len(glyphs.skipped),
        },
        "backgrounds": vocab.source,
        "test": test(judge, train, shades, seed=seed, renders=settings.test_renders),
    }
    if leave_out_style is not None:
        figures["left_out_style"] = leave_out_style
        figures["test_left_out"] = test(
            judge, glyphs.select(held), shades, seed=seed, renders=settings.test_renders
        )
    config.figures = figures
    save_judge(out, net, config)
    write_json(Path(out) / "figures.json", figures)
    return figures
