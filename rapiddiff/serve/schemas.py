"""The request body of ``POST /v1/images/generations`` and its checks.

OpenAI's images API fields (``prompt``, ``n``, ``size``, ``response_format``, ``model``, ``user``)
keep OpenAI's meaning, so the official ``openai`` client works unchanged (``quality`` and ``style``
are accepted and ignored); rapiddiff's own fields
(``negative_prompt``, ``seed``, ``steps``, ...) ride in the same JSON object (the client's
``extra_body``). :func:`check_request` turns a body into pipeline settings or raises
:class:`ApiError`, a 4xx that names the field and what to send instead.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rapiddiff.models.sampling import SamplingDefaults
from rapiddiff.serve.config import ServeConfig, parse_size
from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)

IGNORED_OPENAI_FIELDS = ("quality", "style")
"""OpenAI fields a client may send that mean nothing for this model: accepted, logged, not used."""
MAX_GUIDANCE = 50.0
"""Largest classifier-free guidance scale a request may ask for."""
SCHEDULER_ALIASES = {"plms": "pndm", "dpmsolver++": "dpm++", "dpm-solver++": "dpm++", "dpmpp": "dpm++"}
"""Other names clients use for the samplers (diffusers' and k-diffusion's)."""


class ApiError(Exception):
    """An error the client caused (or a refusal): HTTP ``status`` with OpenAI's error object."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class ImageRequest(BaseModel):
    """``POST /v1/images/generations``; an unknown field is an error, never silently ignored."""

    model_config = ConfigDict(extra="forbid", strict=False)

    # --- OpenAI's images API
    prompt: str = Field(description="what to draw (Chinese or any language the model knows)")
    model: str | None = Field(None, description="the served model's id (GET /v1/models); optional")
    n: int = Field(1, description="number of images; image k gets seed + k")
    size: str | None = Field(
        None,
        description='"WIDTHxHEIGHT" (width first) before upscaling, e.g. "256x128" (default: the model\'s)',
    )
    response_format: str = Field("b64_json", description='only "b64_json" (PNG bytes, base64)')
    output_format: str | None = Field(None, description='only "png"')
    user: str | None = Field(None, description="an end-user id (accepted, not used)")
    quality: str | None = Field(None, description="accepted for OpenAI clients and ignored (logged)")
    style: str | None = Field(None, description="accepted for OpenAI clients and ignored (logged)")
    # --- rapiddiff's own
    negative_prompt: str | None = Field(None, description="what to steer away from")
    seed: int | None = Field(None, description="seed of the first image (default: random; returned)")
    steps: int | None = Field(None, description="denoising steps (default: the model's)")
    guidance: float | None = Field(None, description="classifier-free guidance scale; ≤ 1 turns it off")
    scheduler: str | None = Field(None, description="pndm, ddim or dpm++ (default: the model's)")
    knowledge: bool | Literal["embed", "text", "both", "off"] = Field(
        True,
        description='fuse the knowledge graph\'s facts (false or "off": the base text encoder); or a mode: '
        '"embed" (TransE vectors), "text" (the facts spelled into the prompt), "both"',
    )
    upscale: bool | None = Field(None, description="ESRGAN ×4 (default: the server's setting)")
    init_image: str | None = Field(None, description="img2img: a base64 PNG/JPEG (when the pipeline has it)")
    mask_image: str | None = Field(None, description="inpainting: a base64 mask (white = repaint)")
    strength: float | None = Field(None, description="img2img/inpaint: how much of init_image to redo, 0..1")
    control_image: str | list[str] | None = Field(
        None,
        description="ControlNet: a base64 PNG/JPEG control image, or a list with one per ControlNet the server "
        "loaded (rapiddiff serve --controlnet), in their order",
    )
    control_scale: float | list[float] | None = Field(
        None, description="ControlNet: each net's conditioning scale (one value, or one per net; default 1)"
    )
    control_start: float | list[float] | None = Field(
        None, description="ControlNet: fraction of the steps after which each net acts (default 0)"
    )
    control_end: float | list[float] | None = Field(
        None, description="ControlNet: fraction of the steps after which each net stops (default 1)"
    )


class LinkRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str


@dataclass(frozen=True)
class Settings:
    """Everything that must be equal for two images to share one pipeline call (the batch key)."""

    height: int
    width: int
    steps: int
    guidance: float
    scheduler: str
    knowledge: bool | str
    upscale: bool
    image_key: int = 0  # requests with an init image never share a batch (0: none)


@dataclass
class ModelLimits:
    """What the loaded model accepts, read once from the pipeline when it is loaded."""

    name: str
    default_size: int
    size_multiple: int
    max_tokens: int
    schedulers: tuple[str, ...]
    has_upscaler: bool
    defaults: SamplingDefaults  # the folder's, with the server's --steps over its steps
    pipeline_kwargs: frozenset[str]  # the keyword arguments the pipeline's __call__ takes
    count_tokens: Any  # prompt → number of tokens the text encoder sees (with special tokens)
    aliases: tuple[str, ...] = ()  # other ids requests may give for it ("builtin" for the default built-in)
    controlnets: int = 0  # ControlNets loaded (rapiddiff serve --controlnet)


def decode_image(text: str, param: str) -> Any:
    """A base64 image (optionally a ``data:image/...;base64,`` URL) → PIL image; 400 if it is not one."""
    from PIL import Image, UnidentifiedImageError

    payload = text.split(",", 1)[1] if text.startswith("data:") and "," in text else text
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ApiError(400, f"{param}: not valid base64 ({err})", param=param, code="invalid_base64") from err
    try:
        image = Image.open(io.BytesIO(raw))
        image.load()
    except (UnidentifiedImageError, OSError) as err:
        raise ApiError(
            400, f"{param}: base64 decodes to {len(raw)} bytes that are not a PNG/JPEG image", param=param,
            code="invalid_image",
        ) from err  # fmt: skip
    return image


def check_request(
    req: ImageRequest, limits: ModelLimits, config: ServeConfig
) -> tuple[Settings, dict[str, Any]]:
    """Validate ``req`` against the model and the server's limits.

    Returns the batch key and the per-request pipeline arguments (init/mask image, strength);
    raises :class:`ApiError` (4xx) naming the field at fault.
    """
    _check_output(req, limits)
    _check_count(req, config)
    _check_prompts(req, limits)
    height, width = _check_size(req, limits, config)
    steps, guidance, scheduler = _check_sampling(req, limits, config)
    upscale = _check_upscale(req, limits, config)
    extra, image_key = _check_images(req, limits)
    if _check_control(req, limits, extra):
        image_key = id(extra)  # a request with its own control images never shares a batch
    _note_ignored(req)
    settings = Settings(height, width, steps, guidance, scheduler, req.knowledge, upscale, image_key)
    return settings, extra


def _check_output(req: ImageRequest, limits: ModelLimits) -> None:
    """The OpenAI fields that pick what comes back: the format and the model."""
    if req.response_format != "b64_json":
        raise ApiError(
            400, f'response_format "{req.response_format}" is not served; use "b64_json" (PNG bytes in the response)',
            param="response_format", code="unsupported_response_format",
        )  # fmt: skip
    if req.output_format not in (None, "png"):
        raise ApiError(
            400, f'output_format "{req.output_format}": only "png" is served', param="output_format"
        )
    if req.model not in (None, "", limits.name, *limits.aliases):
        raise ApiError(
            404, f"model '{req.model}' is not served here; this server serves '{limits.name}' (GET /v1/models)",
            param="model", code="model_not_found",
        )  # fmt: skip


def _check_count(req: ImageRequest, config: ServeConfig) -> None:
    """``n`` and the seed of the first image (image k gets seed + k)."""
    if not 1 <= req.n <= config.max_images:
        raise ApiError(
            400, f"n={req.n}: ask for 1 to {config.max_images} images per request", param="n",
            code="too_many_images",
        )  # fmt: skip
    if req.seed is not None and not 0 <= req.seed <= 2**63 - 1 - req.n:
        raise ApiError(400, f"seed={req.seed}: use an integer from 0 to 2^63 - 1 - n", param="seed")


def _check_prompts(req: ImageRequest, limits: ModelLimits) -> None:
    """The prompt and the negative prompt: present, and within what the text encoder reads."""
    if not req.prompt.strip():
        raise ApiError(400, "prompt is empty; describe the image to draw", param="prompt")
    for param, text in (("prompt", req.prompt), ("negative_prompt", req.negative_prompt or "")):
        # Tokenizing runs on the event loop: refuse absurd lengths before it.
        if len(text) > 64 * limits.max_tokens:
            raise ApiError(
                400, f"{param} is {len(text)} characters long; the text encoder reads at most "
                f"{limits.max_tokens} tokens: shorten it", param=param, code="prompt_too_long",
            )  # fmt: skip
        tokens = limits.count_tokens(text)
        if tokens > limits.max_tokens:
            raise ApiError(
                400, f"{param} is {tokens} tokens long; the text encoder reads at most {limits.max_tokens} "
                "(with its 2 special tokens): shorten it", param=param, code="prompt_too_long",
            )  # fmt: skip


def _check_size(req: ImageRequest, limits: ModelLimits, config: ServeConfig) -> tuple[int, int]:
    """``size`` ("WIDTHxHEIGHT", as OpenAI's) → (height, width); the model's size when absent."""
    if req.size in (None, "auto"):
        return limits.default_size, limits.default_size
    try:
        width, height = parse_size(req.size)
    except ValueError as err:
        raise ApiError(400, str(err), param="size", code="invalid_size") from err
    m = limits.size_multiple
    if width % m or height % m or not width or not height:
        raise ApiError(
            400, f'size "{req.size}" (WIDTHxHEIGHT): width and height must be positive multiples of {m} '
            f"for this model (nearest: {_nearest(width, m)}x{_nearest(height, m)})", param="size",
            code="invalid_size",
        )  # fmt: skip
    if max(width, height) > config.max_side:
        raise ApiError(
            400, f'size "{req.size}": the largest side this server samples is {config.max_side}',
            param="size", code="invalid_size",
        )  # fmt: skip
    return height, width


def _check_sampling(req: ImageRequest, limits: ModelLimits, config: ServeConfig) -> tuple[int, float, str]:
    """Steps, guidance and sampler: the request's, else the model folder's defaults."""
    defaults = limits.defaults
    steps = req.steps if req.steps is not None else defaults.num_inference_steps
    if not 1 <= steps <= config.max_steps:
        raise ApiError(
            400, f"steps={steps}: use 1 to {config.max_steps} denoising steps", param="steps",
            code="too_many_steps" if steps > config.max_steps else "invalid_value",
        )  # fmt: skip
    guidance = float(req.guidance if req.guidance is not None else defaults.guidance_scale)
    if not 0 <= guidance <= MAX_GUIDANCE:
        raise ApiError(
            400, f"guidance={guidance}: use a scale from 0 to {MAX_GUIDANCE:g} (≤ 1 turns guidance off)",
            param="guidance",
        )  # fmt: skip
    asked = (req.scheduler or defaults.scheduler).lower()
    scheduler = SCHEDULER_ALIASES.get(asked, asked)
    if scheduler not in limits.schedulers:
        raise ApiError(
            400, f"scheduler '{req.scheduler}': choose one of {', '.join(limits.schedulers)}",
            param="scheduler",
        )  # fmt: skip
    return steps, guidance, scheduler


def _check_upscale(req: ImageRequest, limits: ModelLimits, config: ServeConfig) -> bool:
    """The request's ``upscale``, else the server's setting, else on when the model has an upscaler."""
    upscale = req.upscale if req.upscale is not None else default_upscale(limits, config)
    if upscale and not limits.has_upscaler:
        raise ApiError(400, "upscale: this model has no upscaler; send upscale=false", param="upscale")
    return upscale


def default_upscale(limits: ModelLimits, config: ServeConfig) -> bool:
    """Upscale when a request does not say: the server's ``--upscale``, else as ``rapiddiff generate``."""
    return bool(config.default_upscale if config.default_upscale is not None else limits.has_upscaler)


def _check_images(req: ImageRequest, limits: ModelLimits) -> tuple[dict[str, Any], int]:
    """img2img / inpainting: the decoded images and strength, and the batch key part they need."""
    extra: dict[str, Any] = {}
    image_key = 0
    for param in ("init_image", "mask_image"):
        text = getattr(req, param)
        if text is None:
            continue
        image = decode_image(text, param)  # bad base64 is a 400 whether or not the pipeline has img2img
        if param not in limits.pipeline_kwargs:
            raise ApiError(
                400, f"{param}: this rapiddiff version's pipeline has no img2img/inpainting yet; send text only",
                param=param, code="unsupported",
            )  # fmt: skip
        extra[param] = image.convert("L" if param == "mask_image" else "RGB")
        image_key = id(extra)
    if req.mask_image is not None and req.init_image is None:
        raise ApiError(400, "mask_image needs init_image (the image to inpaint)", param="mask_image")
    if req.strength is not None:
        if req.init_image is None:
            raise ApiError(400, "strength applies to init_image; send one or drop strength", param="strength")
        if not 0 < req.strength <= 1:
            raise ApiError(400, f"strength={req.strength}: use a number in (0, 1]", param="strength")
        extra["strength"] = req.strength
    return extra, image_key


def _check_control(req: ImageRequest, limits: ModelLimits, extra: dict[str, Any]) -> bool:
    """ControlNet: the decoded control images with each net's scale and window into ``extra["control"]``;
    whether there were any."""
    from rapiddiff.models.controlnet import ControlSpec

    knobs = {
        "control_scale": req.control_scale,
        "control_start": req.control_start,
        "control_end": req.control_end,
    }
    if req.control_image is None:
        for param, value in knobs.items():
            if value is not None:
                raise ApiError(
                    400, f"{param} applies to control_image; send one or drop {param}", param=param
                )
        return False
    texts = req.control_image if isinstance(req.control_image, list) else [req.control_image]
    images = [decode_image(text, "control_image").convert("RGB") for text in texts]  # bad base64: 400 first
    if limits.controlnets == 0:
        raise ApiError(
            400, "control_image: this server was started without a ControlNet; start it with "
            "`rapiddiff serve --controlnet PATH` (one per net), or send no control_image",
            param="control_image", code="no_controlnet",
        )  # fmt: skip
    if len(images) != limits.controlnets:
        raise ApiError(
            400, f"control_image: {len(images)} image(s) sent for the {limits.controlnets} ControlNet(s) this "
            "server loaded; send one per net, in the order of its --controlnet flags", param="control_image",
        )  # fmt: skip
    values = {param: _per_net(value, len(images), param) for param, value in knobs.items()}
    specs = []
    for k, image in enumerate(images):
        given = {
            name: values[param][k]
            for param, name in (
                ("control_scale", "controlnet_conditioning_scale"),
                ("control_start", "control_guidance_start"),
                ("control_end", "control_guidance_end"),
            )
            if values[param][k] is not None
        }
        try:
            specs.append(ControlSpec(image, **given))
        except ValueError as err:
            raise ApiError(
                400, f"control: {err}", param="control_scale" if "scale" in str(err) else "control_start"
            ) from err
    extra["control"] = specs
    return True


def _per_net(value: float | list[float] | None, count: int, param: str) -> list[float | None]:
    if value is None:
        return [None] * count
    if not isinstance(value, list):
        return [value] * count
    if len(value) != count:
        raise ApiError(
            400,
            f"{param}: {len(value)} values for {count} ControlNet(s); send one, or one per net",
            param=param,
        )
    return list(value)


def _note_ignored(req: ImageRequest) -> None:
    """OpenAI's fields with no meaning here are accepted and logged, as vLLM notes ignored fields."""
    ignored = {name: getattr(req, name) for name in IGNORED_OPENAI_FIELDS if getattr(req, name) is not None}
    if ignored:
        log.info(
            "ignored (no meaning for this model): %s", ", ".join(f"{k}={v!r}" for k, v in ignored.items())
        )


def _nearest(value: int, multiple: int) -> int:
    return max(multiple, round(value / multiple) * multiple)
