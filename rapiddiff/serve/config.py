"""The server's settings: what it loads, how it batches, and the limits a request must keep."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from rapiddiff.models.builtin import is_builtin_spec

SIZE_FORM = '"WIDTHxHEIGHT" (width first, as OpenAI\'s size), e.g. "256x128" for 256 wide and 128 high'
_SIZE = re.compile(r"\s*(\d+)\s*(?:[xX×*]\s*(\d+))?\s*")


@dataclass
class ServeConfig:
    """Settings of one ``rapiddiff serve`` process (or of one Ray Serve replica)."""

    model: Path | str | None = None
    """Model folder, or ``builtin:NAME`` for a built-in model; ``None`` (or ``builtin``) is the
    default built-in model (or ``$RAPIDDIFF_MODEL``), as in ``rapiddiff generate``."""
    devices: list[str] = field(default_factory=lambda: ["auto"])
    """One model copy and one worker thread per entry: ``auto``, ``cpu``, ``cuda:0``, ``cuda:1``, ..."""
    dtype: str = "auto"
    """``auto`` (fp16 on CUDA, fp32 on CPU), ``float32``, ``float16`` or ``bfloat16``."""
    fast: bool = False
    """Use the pipeline's fast path (``accelerate(pipe)``); ``/ready`` waits for its warm-up."""
    packages: bool = True
    """With ``fast``: start from the AOTInductor packages of this model, GPU, torch and switches
    (``aoti="auto"``: where they are missing or stale, built once in a background process for the
    next start, torch.compile meanwhile); False: torch.compile only."""
    warmup_sizes: list[tuple[int, int]] = field(default_factory=list)
    """(height, width) pairs generated once before ``/ready`` with ``fast`` (default: the model's size);
    ``--warmup-size`` takes them as ``WIDTHxHEIGHT``, the API's form."""
    fast_batches: list[int] = field(default_factory=list)
    """With ``fast``: the batch sizes that get a captured graph; default: powers of two below
    ``max_batch``, and ``max_batch``. A partial batch runs padded up to one of them or split over
    smaller ones, whichever is quicker by the times warm-up measured (``engine.plan_calls``). Each
    costs a compile in warm-up (over a minute for a 512² model), so ``1,8`` is ready sooner, but a
    batch of 4 then costs a batch of 8 (or four of 1)."""
    max_batch: int = 4
    """Most images sampled in one pipeline call (requests of the same size and settings share it)."""
    max_wait_ms: float = 50.0
    """How long the oldest queued request may wait for others to fill its batch — only while others
    could still come (clients just answered, a burst in progress); a lone request never waits."""
    max_queue: int = 256
    """Most images waiting; beyond it a request is refused with 429 (back-pressure, not a growing backlog)."""
    max_images: int = 4
    """Most images one request may ask for (``n``)."""
    max_steps: int = 100
    """Most denoising steps one request may ask for."""
    max_side: int = 1024
    """Largest height or width (before upscaling) one request may ask for."""
    default_steps: int | None = None
    preset: str | None = None
    """A sampling preset's sampler and steps (``rapiddiff.models.sampling.PRESETS``) in place of the
    model's defaults for requests that name none; ``default_steps`` wins over its steps."""
    """Steps when a request names none (default: the model folder's ``SamplingDefaults``)."""
    default_upscale: bool | None = None
    """Upscale when a request does not say (default: as ``rapiddiff generate``, on when the model has one)."""
    loras: list[tuple[str, float]] = field(default_factory=list)
    """LoRAs (path, scale) merged into every model copy at load, as ``rapiddiff generate --lora``."""
    controlnets: list[str] = field(default_factory=list)
    """ControlNets (folders or .safetensors) loaded into every model copy, as ``rapiddiff generate
    --controlnet``; a request then sends one ``control_image`` per net, in this order."""

    def __post_init__(self) -> None:
        if not self.devices:
            raise ValueError("devices: give at least one (e.g. cpu, cuda:0)")
        for name, value in (
            ("max_batch", self.max_batch),
            ("max_queue", self.max_queue),
            ("max_images", self.max_images),
            ("max_steps", self.max_steps),
            ("max_side", self.max_side),
        ):
            if value < 1:
                raise ValueError(f"{name} must be ≥ 1, got {value}")
        if self.fast_batches and (
            sorted(set(self.fast_batches)) != self.fast_batches
            or self.fast_batches[-1] != self.max_batch
            or self.fast_batches[0] < 1
        ):
            raise ValueError(
                f"fast_batches {self.fast_batches}: give increasing sizes ≥ 1 ending at max_batch ({self.max_batch})"
            )
        if self.max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be ≥ 0, got {self.max_wait_ms}")
        if self.preset is not None:
            from rapiddiff.models.sampling import preset

            preset(self.preset)  # an unknown name fails here, listing the presets
        if self.default_steps is not None and not 1 <= self.default_steps <= self.max_steps:
            raise ValueError(
                f"default_steps must be in 1..max_steps ({self.max_steps}), got {self.default_steps}"
            )
        if self.model is not None and not is_builtin_spec(self.model):
            self.model = Path(self.model)


def parse_devices(text: str) -> list[str]:
    """``"0,1"`` → ``["cuda:0", "cuda:1"]``; ``"cpu"``, ``"auto"`` and ``"cuda:N"`` pass through."""
    devices = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"--devices '{text}': empty entry; use e.g. 0,1 or cpu")
        devices.append(f"cuda:{part}" if part.isdigit() else part)
    return devices


def parse_size(text: str) -> tuple[int, int]:
    """``"WIDTHxHEIGHT"`` or ``"N"`` (N×N) → (width, height); ValueError naming the form otherwise."""
    match = _SIZE.fullmatch(text)
    if not match:
        raise ValueError(f'size "{text}": use {SIZE_FORM}')
    width = int(match.group(1))
    height = int(match.group(2)) if match.group(2) else width
    return width, height
