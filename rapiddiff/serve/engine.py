"""One pipeline per device and the micro-batching queue in front of them.

Requests queue as :class:`Job` s. Each device has a worker: an asyncio task that takes the oldest
job, waits up to ``max_wait_ms`` for more jobs with the same :class:`~rapiddiff.serve.schemas.Settings`
(size, steps, guidance, sampler, knowledge, upscale) until ``max_batch`` images are queued, and runs
them as ONE pipeline call in that device's own thread — so the event loop keeps answering while a
GPU (or the CPU) works. Each image keeps its own seed (the pipeline's seed rule), so a request gets
the image ``rapiddiff generate`` makes for its prompt, seed and settings. The rows of a batch are
ordered by seed, so a batch's composition does not depend on the order its requests arrived in.

If a batch fails, each of its requests is run again alone: a request that fails fails alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rapiddiff.serve.config import ServeConfig
from rapiddiff.serve.metrics import Metrics
from rapiddiff.serve.schemas import ApiError, ImageRequest, ModelLimits, Settings, check_request
from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)


@dataclass
class GeneratedImage:
    png: bytes  # the PNG file, metadata chunks included (rapiddiff.infer.png.save_png's bytes)
    seed: int
    metadata: dict[str, Any]


@dataclass
class Job:
    settings: Settings
    prompt: str
    negative: str
    seeds: list[int]
    extra: dict[str, Any]
    future: asyncio.Future[list[GeneratedImage]]
    arrived: float = field(default_factory=time.monotonic)

    @property
    def n(self) -> int:
        return len(self.seeds)


class Worker:
    """One model copy on one device, with the single thread that runs it."""

    def __init__(self, device: str, index: int) -> None:
        self.device = device
        self.index = index
        self.pipe: Any = None
        # One thread per model copy: its calls never overlap, and the event loop never waits on it.
        self.executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix=f"rapiddiff-serve-{index}",
            initializer=_bind_device,
            initargs=(device,),
        )
        self.busy = False


def _bind_device(device: str) -> None:
    """Make a worker thread's current CUDA device its own GPU: CUDA graph capture and the default
    stream follow the thread's current device, which is cuda:0 unless set."""
    if device.startswith("cuda:"):
        import torch

        torch.cuda.set_device(int(device.split(":", 1)[1]))


def load_pipeline(config: ServeConfig, device_name: str) -> Any:
    """The one generation path: ``RapidDiffusionPipeline.from_pretrained`` (+ its fast path)."""
    from rapiddiff.infer.generate_cli import resolve_model_dir
    from rapiddiff.infer.pipeline import RapidDiffusionPipeline
    from rapiddiff.utils.device import resolve_device, resolve_dtype

    device = resolve_device(device_name)
    dtype = resolve_dtype(config.dtype, device)
    model_dir = resolve_model_dir(str(config.model) if config.model else None)
    log.info("loading %s on %s (%s)", model_dir, device, str(dtype).removeprefix("torch."))
    pipe = RapidDiffusionPipeline.from_pretrained(model_dir, device=device, dtype=dtype)
    for path, scale in config.loras:  # before the fast path: LoRAs merge into the weights it transforms
        pipe.load_lora(path, scale=scale)
    if config.fast:
        # The fast path captures one sampling graph per (batch, size, steps): keep one per batch
        # bucket and warmed-up size, so serving never evicts and recaptures them.
        sizes = max(1, len(config.warmup_sizes))
        pipe.enable_fast(max_graphs=len(batch_buckets(config.max_batch, config.fast_batches)) * sizes + 1)
    linker = getattr(pipe.text_encoder, "linker", None)
    if linker is not None:
        linker.link("番茄")  # jieba loads its dictionary on first use: pay that before /ready
    return pipe


def batch_buckets(max_batch: int, chosen: list[int] | None = None) -> list[int]:
    """Batch sizes the fast path runs: ``chosen``, else powers of two below ``max_batch`` and ``max_batch``."""
    if chosen:
        return list(chosen)
    sizes = [1 << k for k in range(max_batch.bit_length()) if 1 << k < max_batch]
    return [*sizes, max_batch]


def model_limits(pipe: Any, config: ServeConfig) -> ModelLimits:
    from rapiddiff.infer.pipeline import scheduler_choices

    # The folder's rapiddiff.json "sampling" over the library's defaults, as the pipeline read it.
    defaults = pipe.sampling.to_dict()
    if config.default_steps is not None:
        defaults["num_inference_steps"] = config.default_steps
    encoder = pipe.text_encoder
    tokenizer = encoder.tokenizer

    def count_tokens(text: str) -> int:
        return len(tokenizer(text, truncation=False, add_special_tokens=True)["input_ids"])

    return ModelLimits(
        name=pipe.model_name,
        default_size=pipe.default_size,
        size_multiple=pipe.size_multiple,
        max_tokens=int(encoder.max_length),
        schedulers=tuple(scheduler_choices()),
        has_upscaler=pipe.upscaler is not None,
        defaults=defaults,
        pipeline_kwargs=frozenset(inspect.signature(pipe.__call__).parameters),
        count_tokens=count_tokens,
    )


class Engine:
    """Loads the model copies, queues requests, batches them and runs them off the event loop."""

    def __init__(self, config: ServeConfig, *, loader: Any = load_pipeline) -> None:
        self.config = config
        self.loader = loader  # (config, device) → pipeline; tests may wrap the real loader
        self.workers = [Worker(device, i) for i, device in enumerate(config.devices)]
        self.metrics = Metrics()
        self.limits: ModelLimits | None = None
        self.ready = False
        self.load_error: str | None = None
        self.pending: list[Job] = []
        self._closing = False
        self._wake: asyncio.Event | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------------ loading
    def load(self) -> None:
        """Load every model copy (one after another) and warm up; for callers without a loop (Ray)."""
        for worker in self.workers:
            worker.pipe = self.loader(self.config, worker.device)
        self._after_load()

    async def start(self) -> None:
        """Load and warm up the copies (each in its worker's thread), then start the workers."""
        loop = asyncio.get_running_loop()
        try:
            # One copy after another (each in its worker's thread, off the event loop): diffusers'
            # lazy module imports are not thread-safe, so parallel first loads can fail.
            for worker in self.workers:
                worker.pipe = await loop.run_in_executor(
                    worker.executor, self.loader, self.config, worker.device
                )
            for worker in self.workers:  # one after another too: torch.compile is not thread-safe
                await loop.run_in_executor(worker.executor, self._warm_up, worker)
            self.limits = model_limits(self.workers[0].pipe, self.config)
            self.ready = True
        except Exception as err:
            self.load_error = f"{type(err).__name__}: {err}"
            log.exception("loading the model failed")
            raise
        self._ensure_workers()
        log.info("ready: %d worker(s) on %s", len(self.workers), ", ".join(w.device for w in self.workers))

    def _after_load(self) -> None:
        for worker in self.workers:
            self._warm_up(worker)
        self.limits = model_limits(self.workers[0].pipe, self.config)
        self.ready = True

    def _warm_up(self, worker: Worker) -> None:
        """With the fast path, sample once per served size and batch bucket at the default steps
        (each is a compiled, captured graph), so /ready means fast."""
        if not self.config.fast:
            return
        pipe = worker.pipe
        sizes = self.config.warmup_sizes or [(pipe.default_size, pipe.default_size)]
        steps = model_limits(pipe, self.config).defaults["num_inference_steps"]
        for height, width in sizes:
            for batch in batch_buckets(self.config.max_batch, self.config.fast_batches):
                t0 = time.perf_counter()
                pipe(["warm-up"] * batch, seed=list(range(batch)), height=height, width=width,
                     num_inference_steps=steps, progress=False)  # fmt: skip
                log.info("warm-up %s %dx%d batch %d: %.1f s", worker.device, height, width, batch,
                         time.perf_counter() - t0)  # fmt: skip

    def _ensure_workers(self) -> None:
        """Start the worker tasks in the running loop (once)."""
        if self._tasks:
            return
        self._wake = asyncio.Event()
        self._tasks = [
            asyncio.create_task(self._worker_loop(w), name=f"rapiddiff-worker-{w.index}")
            for w in self.workers
        ]

    # ------------------------------------------------------------------ requests
    def check(self, req: ImageRequest) -> tuple[Settings, dict[str, Any]]:
        if not self.ready or self.limits is None:
            raise ApiError(503, self.load_error or "the model is still loading; retry when GET /ready answers 200",
                           code="not_ready")  # fmt: skip
        return check_request(req, self.limits, self.config)

    async def generate(self, req: ImageRequest) -> list[GeneratedImage]:
        """Queue one request and wait for its images (raises ApiError for bad input or refusal)."""
        settings, extra = self.check(req)
        if self._closing:
            raise ApiError(503, "the server is shutting down; retry on another replica", code="shutting_down")
        queued = self.queued_images()
        if queued + req.n > self.config.max_queue:
            raise ApiError(429, f"{queued} images are queued (limit {self.config.max_queue}); retry later",
                           code="queue_full")  # fmt: skip
        first = req.seed if req.seed is not None else secrets.randbelow(2**31 - req.n)
        self._ensure_workers()
        job = Job(
            settings=settings,
            prompt=req.prompt,
            negative=req.negative_prompt or "",
            seeds=[first + k for k in range(req.n)],  # as `rapiddiff generate --seed S --num-images N`
            extra=extra,
            future=asyncio.get_running_loop().create_future(),
        )
        self.pending.append(job)
        assert self._wake is not None
        self._wake.set()
        return await job.future

    def queued_images(self) -> int:
        return sum(job.n for job in self.pending)

    # ------------------------------------------------------------------ batching
    def _matching_images(self, settings: Settings) -> int:
        return sum(job.n for job in self.pending if job.settings == settings)

    def _pop_batch(self, head: Job) -> list[Job]:
        """The head and the following jobs with its settings, up to max_batch images (whole requests)."""
        batch, images = [head], head.n
        for job in self.pending[1:]:
            if job.settings == head.settings and images + job.n <= self.config.max_batch:
                batch.append(job)
                images += job.n
        for job in batch:
            self.pending.remove(job)
        return batch

    async def _worker_loop(self, worker: Worker) -> None:
        assert self._wake is not None
        wake = self._wake
        max_wait = self.config.max_wait_ms / 1000
        while True:
            # A request whose client went away (its future cancelled) is not worth sampling.
            self.pending = [job for job in self.pending if not job.future.done()]
            if not self.pending:
                if self._closing:
                    return
                wake.clear()
                await wake.wait()
                continue
            head = self.pending[0]
            # Wait (bounded by the head's deadline) for its batch to fill; another worker may take it.
            while (
                head in self.pending
                and not self._closing
                and self._matching_images(head.settings) < self.config.max_batch
            ):
                remaining = head.arrived + max_wait - time.monotonic()
                if remaining <= 0:
                    break
                wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), remaining)
            if head not in self.pending:
                continue
            batch = self._pop_batch(head)
            worker.busy = True
            try:
                await self._run(worker, batch)
            finally:
                worker.busy = False
                wake.set()  # let an idle worker look at what queued meanwhile

    async def _run(self, worker: Worker, jobs: list[Job]) -> None:
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        waits = [started - job.arrived for job in jobs]
        try:
            results = await loop.run_in_executor(worker.executor, self._generate, worker, jobs)
        except Exception as err:
            if len(jobs) == 1:
                self._fail(jobs[0], err)
                return
            # Someone in the batch broke it: run each alone, so only that request fails.
            log.warning("a batch of %d requests failed (%s); running them one by one", len(jobs), err)
            for job in jobs:
                try:
                    results = await loop.run_in_executor(worker.executor, self._generate, worker, [job])
                except Exception as one_err:
                    self._fail(job, one_err)
                else:
                    self.metrics.observe_batch(job.n, [time.monotonic() - job.arrived])
                    _resolve(job, results[0])
            return
        self.metrics.observe_batch(sum(job.n for job in jobs), waits)
        for job, images in zip(jobs, results, strict=True):
            _resolve(job, images)

    def _fail(self, job: Job, err: Exception) -> None:
        log.error("request failed: %s: %s", type(err).__name__, err)
        if not job.future.done():
            error = err if isinstance(err, ApiError) else ApiError(500, f"generation failed: {type(err).__name__}: {err}",
                                                                   code="generation_failed")  # fmt: skip
            job.future.set_exception(error)

    def _generate(self, worker: Worker, jobs: list[Job]) -> list[list[GeneratedImage]]:
        """Runs in the worker's thread: one pipeline call per ``max_batch`` rows, then PNG bytes."""
        from rapiddiff.infer.png import png_bytes

        s = jobs[0].settings
        rows = sorted(
            ((seed, job.prompt, job.negative, j) for j, job in enumerate(jobs) for seed in job.seeds),
            key=lambda row: (row[0], row[1], row[2]),
        )
        out: list[list[GeneratedImage]] = [[] for _ in jobs]
        by_seed: dict[tuple[int, int], GeneratedImage] = {}
        step = max(1, self.config.max_batch)
        buckets = batch_buckets(self.config.max_batch, self.config.fast_batches)
        for start in range(0, len(rows), step):
            chunk = rows[start : start + step]
            # The fast path runs captured graphs of fixed batch sizes: pad with copies of the last
            # row up to the next bucket (an image depends only on its own row, so the copies are
            # dropped unseen) rather than capture a graph for every batch size.
            rows_run = chunk
            if self.config.fast:
                padded = next(b for b in buckets if b >= len(chunk))
                rows_run = chunk + [chunk[-1]] * (padded - len(chunk))
            result = worker.pipe(
                [r[1] for r in rows_run],
                negative_prompt=[r[2] for r in rows_run],
                seed=[r[0] for r in rows_run],
                num_inference_steps=s.steps,
                guidance_scale=s.guidance,
                height=s.height,
                width=s.width,
                scheduler=s.scheduler,
                upscale=s.upscale,
                knowledge=s.knowledge,
                progress=False,
                **jobs[0].extra,
            )
            pairs = zip(chunk, result.images[: len(chunk)], result.metadata[: len(chunk)], strict=True)
            for (seed, _, _, j), image, meta in pairs:
                # The CLI's PNG encoder, so the bytes are the CLI's (metadata chunks included).
                by_seed[(j, seed)] = GeneratedImage(png_bytes(image, meta), seed, meta)
        for j, job in enumerate(jobs):
            out[j] = [by_seed[(j, seed)] for seed in job.seeds]
        return out

    # ------------------------------------------------------------------ shutdown
    async def close(self) -> None:
        """Stop taking requests, finish every queued one, then free the threads."""
        self._closing = True
        if self._wake is not None:
            self._wake.set()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for worker in self.workers:
            worker.executor.shutdown(wait=True)
        log.info("shut down: queue finished (%d images served)", self.metrics.images)


def _resolve(job: Job, images: list[GeneratedImage]) -> None:
    if not job.future.done():  # the client may have gone (cancelled)
        job.future.set_result(images)
