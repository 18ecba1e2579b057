"""One pipeline per device and the micro-batching queue in front of them.

Requests queue as :class:`Job` s; each device's worker gathers the queued jobs with the same
:class:`~rapiddiff.serve.schemas.Settings` into one pipeline call, run in that device's own
thread, and hands the images to a small PNG-encoding pool. A worker waits for more requests to
fill a batch only while some could still come (:meth:`Engine._company_until`). A failing batch
is retried request by request, so a request that fails fails alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import inspect
import math
import os
import secrets
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rapiddiff.serve.config import ServeConfig
from rapiddiff.serve.metrics import Metrics
from rapiddiff.serve.schemas import ApiError, ImageRequest, ModelLimits, Settings, check_request
from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)

ENCODE_BACKLOG = 2
"""Most sampled batches a worker may leave waiting for the PNG encoder before it samples another."""

RETURN_WINDOW_S = 1.0
"""How long an answer counts as a client that may come back (or ``max_wait``, if longer). Only
whether to wait depends on it, never how long: a client's round trip (5–18 ms on a loaded 2-core
machine) must not have to fit inside ``max_wait`` for its batch-mates to wait for it."""

Encoder = Callable[[np.ndarray, dict[str, Any]], bytes]
"""(one image, H×W×3 floats in [0, 1]; its metadata) → the PNG file's bytes."""


def encode_png(image: np.ndarray, metadata: dict[str, Any]) -> bytes:
    """The CLI's conversion and PNG writer (``to_pil`` + ``png_bytes``), so the bytes are the CLI's."""
    from rapiddiff.infer.pipeline import to_pil
    from rapiddiff.infer.png import png_bytes

    return png_bytes(to_pil(image[None])[0], metadata)


@dataclass
class GeneratedImage:
    png: bytes  # the PNG file, metadata chunks included (rapiddiff.infer.png.save_png's bytes)
    seed: int
    metadata: dict[str, Any]


@dataclass(eq=False)  # a job is itself: `in`/`remove` on the queue compare identity, not fields
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


@dataclass
class Sampled:
    """One request's sampled images, waiting for the PNG encoder (seed, H×W×3 array, metadata)."""

    job: Job
    images: list[tuple[int, np.ndarray, dict[str, Any]]]


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
        self.free_since = time.monotonic()  # when it last finished sampling (or was made)
        self.encoding: set[asyncio.Task[None]] = set()  # its sampled batches the encoder has not finished
        self.unanswered = 0  # requests it sampled that are not answered yet (PNGs being encoded)
        self.answered_at = 0.0  # when the last of them was answered
        # With the fast path: (height, width) → {captured batch size: seconds per call}, from warm-up.
        self.bucket_seconds: dict[tuple[int, int], dict[int, float]] = {}


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
    if config.controlnets:
        pipe.load_controlnet(*config.controlnets)
    if config.fast:
        # The fast path captures one sampling graph per (batch, size, steps): keep one per batch
        # bucket and warmed-up size, so serving never evicts and recaptures them.
        sizes = max(1, len(config.warmup_sizes))
        from rapiddiff.infer.accelerate import accelerate

        graphs = len(batch_buckets(config.max_batch, config.fast_batches)) * sizes + 1
        accelerate(pipe, max_graphs=graphs, aoti="auto" if config.packages else "off")
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


def plan_calls(rows: int, buckets: list[int], seconds: dict[int, float] | None = None) -> list[int]:
    """The captured batch sizes to sample ``rows`` images with (largest first; only the last call
    is padded): the set with the least total ``seconds`` (a call's time at each size, measured in
    warm-up), fewer calls on a tie. Without a time for every size: one call, padded up to the
    smallest size that holds ``rows`` (or the largest, repeated)."""
    if rows <= 0:
        return []
    if not seconds or any(b not in seconds for b in buckets):
        fits = [b for b in buckets if b >= rows]
        return [fits[0]] if fits else [buckets[-1]] * -(-rows // buckets[-1])
    # Unbounded knapsack over row counts: best[n] = cheapest calls that hold n rows (padding allowed).
    best: list[tuple[float, int, list[int]]] = [(0.0, 0, [])]
    for n in range(1, rows + 1):
        options = []
        for b in buckets:
            cost, calls, sizes = best[max(0, n - b)]
            options.append((cost + seconds[b], calls + 1, [b, *sizes]))
        best.append(min(options, key=lambda o: (o[0], o[1])))
    return sorted(best[rows][2], reverse=True)


def served_model_name(config: ServeConfig) -> str:
    """The id ``/v1/models`` lists and the page shows: ``builtin:NAME`` for a built-in model (the
    name ``--model``, ``pretrained:`` and ``finetune merge --base`` take), else the folder's name."""
    from rapiddiff.infer.generate_cli import resolve_model_dir
    from rapiddiff.models.builtin import model_id

    return model_id(resolve_model_dir(str(config.model) if config.model else None))


def served_model_aliases(config: ServeConfig) -> tuple[str, ...]:
    """Other ids a request may name the served model by: ``builtin`` while it is the default
    built-in model (the id this server gave it before the built-in models had names)."""
    from rapiddiff.infer.generate_cli import resolve_model_dir
    from rapiddiff.models.builtin import builtin_model_dir

    served = resolve_model_dir(str(config.model) if config.model else None).resolve()
    return ("builtin",) if served == builtin_model_dir().resolve() else ()


def model_limits(pipe: Any, config: ServeConfig) -> ModelLimits:
    """What requests are checked against, read from the loaded pipeline and the server's settings."""
    from rapiddiff.infer.pipeline import scheduler_choices
    from rapiddiff.models.controlnet import net_count
    from rapiddiff.models.sampling import default_sampler

    def usable(name: str, schedule: Any) -> bool:
        return default_sampler(schedule, name) == name

    # The folder's rapiddiff.json "sampling" over the library's defaults, as the pipeline read it.
    defaults = pipe.sampling
    if config.preset is not None:
        from rapiddiff.models.sampling import preset

        chosen = preset(config.preset)
        if chosen.deep_cache > 1:
            log.warning("preset %s: the server runs no DeepCache; its sampler and steps apply", config.preset)
        defaults = dataclasses.replace(
            defaults, num_inference_steps=chosen.num_inference_steps, scheduler=chosen.scheduler
        )
    if config.default_steps is not None:
        defaults = dataclasses.replace(defaults, num_inference_steps=config.default_steps)
    encoder = pipe.text_encoder
    # A copy of its own: request checks run on the event loop while the worker thread encodes, and a
    # fast tokenizer keeps padding and truncation as state on its Rust backend (set per call), so a
    # shared one can hand the worker's batch unpadded rows ("Unable to create tensor").
    tokenizer = copy.deepcopy(encoder.tokenizer)

    def count_tokens(text: str) -> int:
        return len(tokenizer(text, truncation=False, add_special_tokens=True)["input_ids"])

    return ModelLimits(
        name=served_model_name(config),
        aliases=served_model_aliases(config),
        default_size=pipe.default_size,
        size_multiple=pipe.size_multiple,
        max_tokens=int(encoder.max_length),
        # A zero-terminal-SNR model: only the samplers that can step from ᾱ_T = 0 (a clear 400 for pndm).
        schedulers=tuple(s for s in scheduler_choices() if usable(s, pipe.scheduler.config)),
        has_upscaler=pipe.upscaler is not None,
        defaults=defaults,
        pipeline_kwargs=frozenset(inspect.signature(pipe.__call__).parameters),
        count_tokens=count_tokens,
        controlnets=net_count(getattr(pipe, "controlnet", None)),
    )


class Engine:
    """Loads the model copies, queues requests, batches them and runs them off the event loop."""

    def __init__(
        self, config: ServeConfig, *, loader: Any = load_pipeline, encoder: Encoder = encode_png
    ) -> None:
        self.config = config
        self.loader = loader  # (config, device) → pipeline; tests may wrap the real loader
        self.encoder = encoder  # (image, metadata) → PNG bytes; runs in the encode pool
        self.workers = [Worker(device, i) for i, device in enumerate(config.devices)]
        # PNG encoding (zlib releases the GIL) for every worker; small, so it never crowds the CPU
        # that feeds the GPUs.
        self.encode_pool = ThreadPoolExecutor(
            max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="rapiddiff-encode"
        )
        self.metrics = Metrics()
        self.limits: ModelLimits | None = None
        self.ready = False
        self.load_error: str | None = None
        self.pending: list[Job] = []
        self._closing = False
        self._wake: asyncio.Event | None = None
        self._tasks: list[asyncio.Task[None]] = []
        # Evidence that company may come (see _company_until): answer times not yet matched by an
        # arrival, requests sampled and waiting for the encoder, and recent arrivals of new clients.
        self._answered: deque[float] = deque()
        self._encoding_jobs = 0
        self._fresh: deque[Job] = deque()

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
        (each is a compiled, captured graph), so /ready means fast; then once more, timed, so a
        partial batch can run as the quickest set of captured sizes (:func:`plan_calls`)."""
        if not self.config.fast:
            return
        pipe = worker.pipe
        sizes = self.config.warmup_sizes or [(pipe.default_size, pipe.default_size)]
        steps = model_limits(pipe, self.config).defaults.num_inference_steps
        buckets = batch_buckets(self.config.max_batch, self.config.fast_batches)
        for height, width in sizes:
            seconds: dict[int, float] = {}
            for batch in buckets:
                times = []
                for _ in range(2 if len(buckets) > 1 else 1):  # one size: nothing to choose, no timing
                    t0 = time.perf_counter()
                    pipe(["warm-up"] * batch, seed=list(range(batch)), height=height, width=width,
                         num_inference_steps=steps, progress=False)  # fmt: skip
                    times.append(time.perf_counter() - t0)
                seconds[batch] = times[-1]
                log.info("warm-up %s %dx%d batch %d: %s", worker.device, height, width, batch,
                         " then ".join(f"{t:.2f} s" for t in times))  # fmt: skip
            if len(buckets) > 1:
                worker.bucket_seconds[(height, width)] = seconds

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
    def loaded_limits(self) -> ModelLimits:
        """The loaded model's limits; a 503 while it loads, or with the reason loading failed."""
        if self.load_error:
            raise ApiError(503, f"the model failed to load: {self.load_error}", code="model_failed")
        if not self.ready or self.limits is None:
            raise ApiError(
                503, "the model is still loading; retry when GET /ready answers 200", code="not_ready"
            )
        return self.limits

    def check(self, req: ImageRequest) -> tuple[Settings, dict[str, Any]]:
        return check_request(req, self.loaded_limits(), self.config)

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
        self._forget_old(job.arrived)
        if self._answered:  # most likely a client that was just answered, coming back
            answered = self._answered.popleft()
            log.debug("a request %.1f ms after an answer: taken for that client coming back",
                      1000 * (job.arrived - answered))  # fmt: skip
        else:
            self._fresh.append(job)
        self.pending.append(job)
        assert self._wake is not None
        self._wake.set()
        return await job.future

    def queued_images(self) -> int:
        return sum(job.n for job in self.pending)

    # ------------------------------------------------------------------ batching
    def _matching_images(self, settings: Settings) -> int:
        return sum(job.n for job in self.pending if job.settings == settings)

    def _return_window(self) -> float:
        return max(self.config.max_wait_ms / 1000, RETURN_WINDOW_S)

    def _forget_old(self, now: float) -> None:
        """Drop stale evidence: a client not back within the return window, or a burst quiet for
        ``max_wait``, is not worth waiting for."""
        while self._answered and self._answered[0] <= now - self._return_window():
            self._answered.popleft()
        while self._fresh and self._fresh[0].arrived <= now - self.config.max_wait_ms / 1000:
            self._fresh.popleft()

    def _company_until(self, head: Job, now: float) -> float | None:
        """Until when another request may still come to join ``head`` (a time to look again by),
        or ``None`` when nothing suggests one will.

        A fixed batch timeout would cost a client that sends one request at a time the whole wait
        on every request, so the worker waits only on evidence of company:

        * *returning clients*: answers of the last :data:`RETURN_WINDOW_S` not yet matched by an
          arrival (clients answered by one batch come back together; a lone client's answer is
          matched by its own next request, which then runs at once);
        * *a burst in progress*: another request with the head's settings, not a returning client,
          that arrived within ``max_wait`` and is not answered yet.

        The worker loop also ends the wait when the batch is full, or ``max_wait`` after the latest
        of the head's arrival, the worker's last batch and that batch's last answer."""
        self._forget_old(now)
        if self._encoding_jobs:  # answered within milliseconds; their clients may come back
            return math.inf
        times = []
        if self._answered:  # answered clients not yet back
            times.append(self._answered[0] + self._return_window())
        others = [job.arrived for job in self._fresh if job is not head and job.settings == head.settings]
        if others:  # a burst of new clients in progress (of this batch's settings)
            times.append(max(others) + self.config.max_wait_ms / 1000)
        return min(times) if times else None

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
            if len(worker.encoding) >= ENCODE_BACKLOG:  # the encoder is the bottleneck: let it catch up
                await asyncio.wait(worker.encoding, return_when=asyncio.FIRST_COMPLETED)
                continue
            head = self.pending[0]
            # Wait for the head's batch to fill while company may still come (_company_until), at
            # most max_wait after the head arrived, this worker became free, or the requests of its
            # last batch were answered (their clients may come back); another worker may take it.
            while (
                head in self.pending
                and not self._closing
                and self._matching_images(head.settings) < self.config.max_batch
            ):
                now = time.monotonic()
                until = self._company_until(head, now)
                deadline = (
                    math.inf  # answered within milliseconds: then max_wait for their clients
                    if worker.unanswered and max_wait > 0
                    else max(head.arrived, worker.free_since, worker.answered_at) + max_wait
                )
                if until is None or now >= deadline:
                    break
                wake.clear()
                timeout = min(deadline, until) - now  # infinite while answers are being encoded
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), None if math.isinf(timeout) else timeout)
            if head not in self.pending:
                continue
            batch = self._pop_batch(head)
            worker.busy = True
            try:
                await self._run(worker, batch)
            finally:
                worker.busy = False
                worker.free_since = time.monotonic()
                wake.set()  # let an idle worker look at what queued meanwhile

    async def _run(self, worker: Worker, jobs: list[Job]) -> None:
        """Sample ``jobs`` in the worker's thread, then hand them to the encoder without waiting."""
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        waits = [started - job.arrived for job in jobs]
        try:
            sampled = await loop.run_in_executor(worker.executor, self._sample, worker, jobs)
        except Exception as err:
            if len(jobs) == 1:
                self._fail(jobs[0], err)
                return
            # Someone in the batch broke it: run each alone, so only that request fails.
            log.warning("a batch of %d requests failed (%s); running them one by one", len(jobs), err)
            for job, wait in zip(jobs, waits, strict=True):
                try:
                    one = await loop.run_in_executor(worker.executor, self._sample, worker, [job])
                except Exception as one_err:
                    self._fail(job, one_err)
                else:
                    self.metrics.observe_batch(job.n, [wait])
                    self._encode_later(worker, one)
            return
        self.metrics.observe_batch(sum(job.n for job in jobs), waits)
        self._encode_later(worker, sampled)

    def _encode_later(self, worker: Worker, sampled: list[Sampled]) -> None:
        self._encoding_jobs += len(sampled)
        worker.unanswered += len(sampled)
        task = asyncio.create_task(self._encode(worker, sampled))
        worker.encoding.add(task)
        task.add_done_callback(worker.encoding.discard)

    async def _encode(self, worker: Worker, sampled: list[Sampled]) -> None:
        """Each request's PNGs in the encode pool, answered as soon as they are ready; an encoding
        error fails that request only."""
        loop = asyncio.get_running_loop()

        async def one(item: Sampled) -> None:
            try:
                images = await loop.run_in_executor(self.encode_pool, self._encode_job, item)
            except Exception as err:
                self._fail(item.job, err)
            else:
                _resolve(item.job, images)
            finally:
                self._encoding_jobs -= 1
                worker.unanswered -= 1
                worker.answered_at = time.monotonic()
                # Answered: no longer a sign of a burst, but its client may come back with another.
                with contextlib.suppress(ValueError):
                    self._fresh.remove(item.job)
                if not item.job.future.cancelled():
                    self._answered.append(time.monotonic())
                if self._wake is not None:
                    self._wake.set()

        await asyncio.gather(*(one(item) for item in sampled))

    def _encode_job(self, item: Sampled) -> list[GeneratedImage]:
        """Runs in the encode pool: one request's images → PNG files (the CLI's bytes)."""
        return [GeneratedImage(self.encoder(image, meta), seed, meta) for seed, image, meta in item.images]

    def _fail(self, job: Job, err: Exception) -> None:
        log.error("request failed: %s: %s", type(err).__name__, err)
        if not job.future.done():
            error = err if isinstance(err, ApiError) else ApiError(500, f"generation failed: {type(err).__name__}: {err}",
                                                                   code="generation_failed")  # fmt: skip
            job.future.set_exception(error)

    def _sample(self, worker: Worker, jobs: list[Job]) -> list[Sampled]:
        """Runs in the worker's thread: pipeline calls of up to ``max_batch`` rows; the images come
        back as arrays (copies on the host, safe from the next call) for the encoder."""
        s = jobs[0].settings
        # Each image keeps its own seed, and rows go by seed: a request gets `rapiddiff generate`'s
        # image, whatever the order its batch-mates arrived in.
        rows = sorted(
            ((seed, job.prompt, job.negative, j) for j, job in enumerate(jobs) for seed in job.seeds),
            key=lambda row: (row[0], row[1], row[2]),
        )
        by_seed: dict[tuple[int, int], tuple[int, np.ndarray, dict[str, Any]]] = {}
        buckets = batch_buckets(self.config.max_batch, self.config.fast_batches)
        calls: list[list[tuple[int, str, str, int]]] = []
        for start in range(0, len(rows), max(1, self.config.max_batch)):
            chunk = rows[start : start + self.config.max_batch]
            if not self.config.fast:
                calls.append(chunk)
                continue
            # The fast path runs captured graphs of fixed batch sizes: run the chunk as the
            # quickest set of them, the last padded with copies of its last row (an image depends
            # only on its own row, so the copies are dropped unseen).
            for size in plan_calls(len(chunk), buckets, worker.bucket_seconds.get((s.height, s.width))):
                part, chunk = chunk[:size], chunk[size:]
                calls.append(part + [part[-1]] * (size - len(part)))
        for rows_run in calls:
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
                output_type="np",  # PIL conversion and PNG encoding happen in the encode pool
                progress=False,
                **jobs[0].extra,
            )
            for (seed, _, _, j), image, meta in zip(rows_run, result.images, result.metadata, strict=True):
                by_seed.setdefault((j, seed), (seed, image, meta))  # padding copies repeat a key
        return [Sampled(job, [by_seed[(j, seed)] for seed in job.seeds]) for j, job in enumerate(jobs)]

    # ------------------------------------------------------------------ shutdown
    async def close(self) -> None:
        """Stop taking requests, finish every queued one (sampled and encoded), then free the threads."""
        self._closing = True
        if self._wake is not None:
            self._wake.set()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        encoding = [task for worker in self.workers for task in worker.encoding]
        if encoding:
            await asyncio.gather(*encoding, return_exceptions=True)
        for worker in self.workers:
            worker.executor.shutdown(wait=True)
        self.encode_pool.shutdown(wait=True)
        log.info("shut down: queue finished (%d images served)", self.metrics.images)


def _resolve(job: Job, images: list[GeneratedImage]) -> None:
    if not job.future.done():  # the client may have gone (cancelled)
        job.future.set_result(images)
