"""The engine: a failing request fails alone, workers never block the loop, shutdown drains the queue."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import threading
import time

import httpx
import pytest

from rapiddiff.serve.app import create_app
from rapiddiff.serve.config import ServeConfig, parse_devices
from rapiddiff.serve.engine import Engine, batch_buckets, encode_png, load_pipeline, model_limits, plan_calls
from rapiddiff.serve.metrics import quantile
from rapiddiff.serve.schemas import ApiError, ImageRequest

from .conftest import FAST_FLAGS, MODEL, metric, serve_in_thread, serve_process

POISON = "💥"
HOLD = "⏸"


class RecordingPipeline:
    """The real pipeline, recording each call's rows and thread; a prompt with 💥 makes a call fail
    (a fault injected to see that only that request fails, not its batch-mates); a prompt with ⏸
    holds its call until ``gate`` is set (to keep a worker busy while a test queues requests)."""

    def __init__(self, pipe: object, calls: list, gate: threading.Event | None = None) -> None:
        self.pipe, self.calls, self.gate = pipe, calls, gate

    def __getattr__(self, name: str) -> object:
        return getattr(self.pipe, name)

    def __call__(self, prompts, **kwargs):
        self.calls.append((list(prompts), threading.current_thread().name))
        if any(POISON in p for p in prompts):
            raise RuntimeError("injected failure")
        if self.gate is not None and any(HOLD in p for p in prompts):
            assert self.gate.wait(timeout=120), "the test never opened the gate"
        return self.pipe(prompts, **kwargs)


@pytest.fixture(scope="module")
def recorded():
    """Two model copies on the CPU (two workers), every pipeline call recorded; ⏸ prompts wait for the gate."""
    calls: list = []
    gate = threading.Event()
    config = ServeConfig(
        model=MODEL,
        devices=["cpu", "cpu"],
        default_steps=2,
        default_upscale=False,
        max_batch=4,
        max_wait_ms=500,
    )

    def loader(cfg, device):
        return RecordingPipeline(load_pipeline(cfg, device), calls, gate)

    engine = Engine(config, loader=loader)
    with serve_in_thread(create_app(engine=engine)) as url:
        yield url, calls, gate


def test_a_failing_request_fails_alone(recorded):
    url, calls, gate = recorded
    calls.clear()
    gate.clear()
    three = ["一只熊猫", f"番茄{POISON}", "香蕉"]

    async def send_all():
        async with httpx.AsyncClient(timeout=180) as client:
            post = lambda body: client.post(f"{url}/v1/images/generations", json=body)  # noqa: E731
            # Both workers held (other settings: nothing can join them), so the three queue together.
            holders = [
                asyncio.create_task(post({"prompt": f"{HOLD}{k}", "size": "96x96", "steps": 2 + k}))
                for k in range(2)
            ]
            await until(client, url, "rapiddiff_workers_busy", 2)
            bodies = [{"prompt": p, "seed": s} for s, p in enumerate(three, start=1)]
            sent = [asyncio.create_task(post(b)) for b in bodies]
            await until(client, url, 'rapiddiff_queue_depth{unit="requests"}', 3)
            gate.set()
            assert [(await h).status_code for h in holders] == [200, 200]
            return await asyncio.wait_for(asyncio.gather(*sent), 240)

    good, bad, other = asyncio.run(send_all())
    assert good.status_code == 200 and other.status_code == 200
    assert bad.status_code == 500 and bad.json()["error"]["code"] == "generation_failed"
    assert "injected failure" in bad.json()["error"]["message"]
    # The three rode one batch (rows ordered by seed); then each ran alone, and only 💥 failed.
    rows = [c[0] for c in calls if HOLD not in c[0][0]]
    assert rows[0] == three
    assert sorted(r[0] for r in rows[1:]) == sorted(three) and all(len(r) == 1 for r in rows[1:])
    assert httpx.get(f"{url}/health").status_code == 200


async def until(client: httpx.AsyncClient, url: str, name: str, value: float) -> None:
    """Poll /metrics (bounded) until the sample ``name`` reaches ``value``."""
    for _ in range(1200):
        if metric((await client.get(f"{url}/metrics")).text, name) >= value:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{name} never reached {value}")


def test_the_event_loop_answers_while_a_worker_samples(recorded):
    url, _, _ = recorded

    async def scenario():
        async with httpx.AsyncClient(timeout=180) as client:
            long = asyncio.create_task(
                client.post(
                    f"{url}/v1/images/generations", json={"prompt": "一只熊猫", "steps": 30, "seed": 4}
                )
            )
            for _ in range(400):  # bounded: until a worker runs the batch
                if metric((await client.get(f"{url}/metrics")).text, "rapiddiff_workers_busy") >= 1:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("no worker became busy")
            health = await client.get(f"{url}/health")
            still_busy = metric((await client.get(f"{url}/metrics")).text, "rapiddiff_workers_busy")
            return health, still_busy, await long

    health, still_busy, long = asyncio.run(scenario())
    # /health and /metrics were answered while the batch was still sampling in its thread.
    assert health.status_code == 200 and still_busy >= 1
    assert long.status_code == 200


def test_two_workers_sample_in_their_own_threads(recorded):
    url, calls, _ = recorded
    calls.clear()

    async def send_all():
        async with httpx.AsyncClient(timeout=180) as client:
            # Different sizes cannot share a batch: two batches, one per worker.
            bodies = [
                {"prompt": "一只熊猫", "size": "128x128", "steps": 6},
                {"prompt": "香蕉", "size": "96x96", "steps": 6},
            ]
            return await asyncio.wait_for(
                asyncio.gather(*(client.post(f"{url}/v1/images/generations", json=b) for b in bodies)), 240
            )

    responses = asyncio.run(send_all())
    assert [r.status_code for r in responses] == [200, 200]
    assert {c[1] for c in calls} == {"rapiddiff-serve-0_0", "rapiddiff-serve-1_0"}
    assert metric(httpx.get(f"{url}/metrics").text, "rapiddiff_workers") == 2


@pytest.mark.slow  # a server process of its own: ~20 s on 2 idle cores
def test_graceful_shutdown_finishes_the_queue(tmp_path):
    log = tmp_path / "server.log"
    with serve_process(*FAST_FLAGS, "--max-batch", "1", "--max-wait-ms", "0", log=log) as (url, proc):
        results: list = []

        def post(seed: int) -> None:
            # 20 steps: long enough that the worker is still busy when the third request arrives.
            body = {"prompt": "一只熊猫", "seed": seed, "steps": 20}
            results.append(httpx.post(f"{url}/v1/images/generations", json=body, timeout=180).status_code)

        def received() -> tuple[float, float]:
            """(requests the server holds or has served, requests still queued)."""
            text = httpx.get(f"{url}/metrics").text
            queued = metric(text, 'rapiddiff_queue_depth{unit="requests"}')
            return queued + metric(text, "rapiddiff_workers_busy") + metric(
                text, "rapiddiff_images_total"
            ), queued

        threads = [threading.Thread(target=post, args=(s,)) for s in range(3)]
        deadline = time.monotonic() + 60
        # One at a time, each until the server has it: a SIGTERM before the last request has
        # connected would refuse it (a loaded machine may start a thread late).
        for count, t in enumerate(threads, start=1):
            t.start()
            while (state := received())[0] < count:
                assert time.monotonic() < deadline, f"request {count} never reached the server"
                time.sleep(0.02)
        assert state[1] >= 1, "the first requests finished before the last one arrived"
        proc.send_signal(signal.SIGTERM)  # while requests are queued
        for t in threads:
            t.join(timeout=180)
        # uvicorn re-raises the signal once it has shut down cleanly (exit status -SIGTERM).
        assert proc.wait(timeout=120) in (0, -signal.SIGTERM)
    assert results == [200, 200, 200]
    assert "queue finished (3 images served)" in log.read_text()


def test_config_and_helpers():
    assert parse_devices("0,1") == ["cuda:0", "cuda:1"]
    assert parse_devices("cpu") == ["cpu"]
    with pytest.raises(ValueError, match="empty entry"):
        parse_devices("0,,1")
    with pytest.raises(ValueError, match="max_batch must be ≥ 1"):
        ServeConfig(max_batch=0)
    with pytest.raises(ValueError, match="default_steps"):
        ServeConfig(default_steps=500)
    with pytest.raises(ValueError, match="ending at max_batch"):
        ServeConfig(max_batch=8, fast_batches=[1, 4])
    assert batch_buckets(1) == [1] and batch_buckets(8) == [1, 2, 4, 8] and batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(8, [1, 8]) == [1, 8]
    assert quantile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.0
    assert quantile([3.0, 1.0, 2.0, 4.0], 0.95) == 4.0


def test_fast_batches_run_as_the_quickest_warmed_up_sizes():
    """With the fast path, warm-up samples each batch bucket twice (the second call timed), and a
    batch of 3 runs as the quickest set of buckets by those times: padded to 4 (copies of its last
    row) when a call of 4 costs what a call of 1 does, split 2 + 1 when time grows with the batch;
    its 3 images answered either way. The pipeline here is the eager one, recorded, so the times
    are set by the test."""
    calls: list = []
    config = ServeConfig(
        model=MODEL,
        devices=["cpu"],
        fast=True,
        max_batch=4,
        default_steps=1,
        default_upscale=False,
        max_wait_ms=100,
    )
    eager = load_pipeline(dataclasses.replace(config, fast=False), "cpu")
    engine = Engine(config, loader=lambda cfg, device: RecordingPipeline(eager, calls))

    async def batch_of_three(first_seed: int):
        requests = [ImageRequest(prompt="番茄", seed=first_seed + k, steps=1) for k in range(3)]
        return await asyncio.wait_for(asyncio.gather(*(engine.generate(r) for r in requests)), 240)

    async def scenario():
        await engine.start()
        try:
            measured = dict(engine.workers[0].bucket_seconds)
            warm_up = [len(c[0]) for c in calls]
            [(size, seconds)] = measured.items()
            engine.workers[0].bucket_seconds[size] = {1: 1.0, 2: 1.0, 4: 1.0}  # a GPU with room to spare
            del calls[:]
            padded = await batch_of_three(5)
            padded_calls = [len(c[0]) for c in calls]
            engine.workers[0].bucket_seconds[size] = {1: 1.0, 2: 1.5, 4: 4.0}  # time grows with the batch
            del calls[:]
            split = await batch_of_three(8)
            return warm_up, seconds, padded, padded_calls, split, [c[0] for c in calls]
        finally:
            await engine.close()

    warm_up, seconds, padded, padded_calls, split, split_calls = asyncio.run(scenario())
    assert warm_up == [1, 1, 2, 2, 4, 4]
    assert sorted(seconds) == [1, 2, 4] and all(t > 0 for t in seconds.values())
    assert padded_calls == [4]
    assert [images[0].seed for images in padded] == [5, 6, 7]
    assert [len(c) for c in split_calls] == [2, 1]
    assert [images[0].seed for images in split] == [8, 9, 10]
    assert engine.metrics.batch_images == {3: 2}


def test_plan_calls():
    assert plan_calls(3, [1, 2, 4]) == [4]  # no times: pad up to the next size, as before
    assert plan_calls(3, [1, 2, 4], {1: 1.0, 2: 1.0, 4: 1.0}) == [4]
    assert plan_calls(3, [1, 2, 4], {1: 1.0, 2: 1.5, 4: 4.0}) == [2, 1]
    # The H100's SD 1.5 figures at 25 steps (batch 1: 0.27 s, batch 8: 1.0 s): four rows pad to 8
    # (1.0 s) rather than run as four calls of 1 (1.08 s); two rows run as two calls of 1.
    assert plan_calls(4, [1, 8], {1: 0.27, 8: 1.0}) == [8]
    assert plan_calls(2, [1, 8], {1: 0.27, 8: 1.0}) == [1, 1]
    assert plan_calls(6, [1, 2, 4, 8], {1: 0.27, 2: 0.35, 4: 0.55, 8: 1.0}) == [4, 2]
    assert plan_calls(0, [1, 8], {1: 0.27, 8: 1.0}) == []


def test_a_served_lora_is_merged_into_the_model(tiny_folders, diffusers_lora):
    """`rapiddiff serve --lora DIR:SCALE` merges the LoRA as `rapiddiff generate --lora` does:
    the served images are the LoRA's and their metadata names it."""
    config = ServeConfig(model=tiny_folders["clip"], devices=["cpu"], dtype="float32")
    kwargs = {"num_inference_steps": 2, "seed": 3, "output_type": "np", "progress": False}
    plain = load_pipeline(config, "cpu")("一个番茄", **kwargs)
    served = load_pipeline(dataclasses.replace(config, loras=[(str(diffusers_lora), 0.7)]), "cpu")
    reference = load_pipeline(config, "cpu")
    reference.load_lora(diffusers_lora, scale=0.7)
    out = served("一个番茄", **kwargs)
    assert out.metadata[0]["lora"] == [{"path": str(diffusers_lora.resolve()), "scale": 0.7}]
    assert abs(out.images - plain.images).max() > 1e-3
    assert (out.images == reference("一个番茄", **kwargs).images).all()


# ---------------------------------------------------------------- when to wait, and encoding off the worker


@pytest.fixture(scope="module")
def builtin_pipe():
    """The built-in kshapes model on the CPU, loaded once for the engine tests below (each builds its engine)."""
    return load_pipeline(ServeConfig(model=MODEL, devices=["cpu"]), "cpu")


def run_engine(
    config: ServeConfig,
    pipe,
    scenario,
    *,
    calls: list | None = None,
    encoder=encode_png,
    wrap=RecordingPipeline,
):
    """Start an engine on ``pipe`` (recorded into ``calls``), run ``scenario(engine)``, close it."""
    recorded = wrap(pipe, [] if calls is None else calls)
    engine = Engine(config, loader=lambda cfg, device: recorded, encoder=encoder)

    async def main():
        await engine.start()
        try:
            return await asyncio.wait_for(scenario(engine), 240)
        finally:
            await engine.close()

    return engine, asyncio.run(main())


def quick(**kwargs) -> ServeConfig:
    return ServeConfig(model=MODEL, devices=["cpu"], default_steps=1, default_upscale=False, **kwargs)


def test_a_lone_request_does_not_wait_for_company(builtin_pipe):
    """One client, one request at a time: nothing could join its batch, so it is sampled at once
    (the queue wait the engine records stays far below max_wait: 3 s here)."""

    async def one_client(engine):
        for seed in range(3):  # a new client, then the same client coming back twice
            await engine.generate(ImageRequest(prompt="番茄", seed=seed))

    engine, _ = run_engine(quick(max_batch=4, max_wait_ms=3000), builtin_pipe, one_client)
    assert engine.metrics.batch_images == {1: 3}
    waits = list(engine.metrics.queue_wait)
    assert len(waits) == 3 and max(waits) < 1.0, waits


@pytest.mark.parametrize(
    ("clients", "max_batch", "batches"),
    [
        # Four clients answered by one batch come back one by one: the first waits for the other
        # three, and no longer (not for a batch of 8 that cannot form).
        (4, 8, {4: 3}),
        # Eight clients, batches of 4: every batch is full (the c=16 case of the load benchmark).
        (8, 4, {4: 6}),
    ],
)
def test_concurrent_clients_are_still_batched(builtin_pipe, clients, max_batch, batches):
    """Closed-loop clients (each sends its next request when answered), as in benchmarks/serve_load.py."""
    max_wait = 2.0

    async def client(engine, k):
        for r in range(3):
            await engine.generate(ImageRequest(prompt=f"番茄{k}", seed=100 * k + r))
            await asyncio.sleep(0.01 * k)  # clients come back at different moments

    async def scenario(engine):
        await asyncio.gather(*(client(engine, k) for k in range(clients)))

    engine, _ = run_engine(quick(max_batch=max_batch, max_wait_ms=max_wait * 1000), builtin_pipe, scenario)
    assert engine.metrics.batch_images == batches
    if max_batch > clients:
        # After the first round (a burst of new clients, which may wait for more of the burst),
        # returning clients do not wait out max_wait for the batch of 8.
        later = list(engine.metrics.queue_wait)[clients:]
        assert max(later) < max_wait / 2, later


def test_clients_split_by_a_lone_first_request_come_back_in_step(builtin_pipe):
    """The first request of a burst runs alone (it does not wait); the rest queue behind it. When
    it is answered, its client's next request joins them: from then on the four are one batch."""
    gate = threading.Event()
    calls: list = []

    class Held(RecordingPipeline):
        def __init__(self, pipe, calls):
            super().__init__(pipe, calls, gate)

    async def client(engine, k):
        for r in range(3):
            prompt = f"{HOLD}番茄" if (k, r) == (0, 0) else f"番茄{k}"
            await engine.generate(ImageRequest(prompt=prompt, seed=100 * k + r))

    async def scenario(engine):
        first = asyncio.create_task(client(engine, 0))
        while not calls:  # bounded by run_engine's timeout: until the first request is sampling
            await asyncio.sleep(0.01)
        others = [asyncio.create_task(client(engine, k)) for k in (1, 2, 3)]
        while len(engine.pending) < 3:
            await asyncio.sleep(0.01)
        gate.set()
        await asyncio.gather(first, *others)

    engine, _ = run_engine(
        quick(max_batch=8, max_wait_ms=2000), builtin_pipe, scenario, calls=calls, wrap=Held
    )
    # alone; the three with the first client's second request; all four; the last three
    assert [len(c[0]) for c in calls] == [1, 4, 4, 3]
    assert engine.metrics.batch_images == {1: 1, 4: 2, 3: 1}
    assert engine.metrics.queue_wait[0] < 1.0  # the lone first request did not wait


def test_the_worker_samples_the_next_batch_while_the_last_is_encoded(builtin_pipe):
    """PNG encoding runs in the encode pool: the worker's next pipeline call starts before the last
    batch's PNGs are done (the encoder of the first image waits for that call to begin)."""
    calls: list = []
    second_call = threading.Event()
    seen: list = []

    class Signalling(RecordingPipeline):
        def __call__(self, prompts, **kwargs):
            if prompts[0] == "香蕉":
                second_call.set()
            return super().__call__(prompts, **kwargs)

    def slow_encoder(image, meta):
        if meta["prompt"] == "一只熊猫":
            seen.append((second_call.wait(timeout=30), threading.current_thread().name))
        return encode_png(image, meta)

    async def scenario(engine):
        panda = engine.generate(ImageRequest(prompt="一只熊猫", seed=1))
        banana = engine.generate(ImageRequest(prompt="香蕉", seed=2, steps=2))  # other settings: next batch
        return await asyncio.gather(panda, banana)

    _, (panda, banana) = run_engine(
        quick(max_batch=4, max_wait_ms=0),
        builtin_pipe,
        scenario,
        calls=calls,
        encoder=slow_encoder,
        wrap=Signalling,
    )
    assert [c[0] for c in calls] == [["一只熊猫"], ["香蕉"]]
    assert len(seen) == 1 and seen[0][0], "the second batch did not start while the first was encoded"
    assert seen[0][1].startswith("rapiddiff-encode") and calls[0][1].startswith("rapiddiff-serve-0")
    assert panda[0].png.startswith(b"\x89PNG") and banana[0].png.startswith(b"\x89PNG")


def test_a_failing_encode_fails_only_its_request(builtin_pipe):
    """An image whose PNG cannot be written fails its request; its batch-mates are answered."""
    calls: list = []
    BAD_PNG = "🧨"  # the encoder's fault trigger, as 💥 is the pipeline's

    def encoder(image, meta):
        if BAD_PNG in meta["prompt"]:
            raise OSError("injected encoder failure")
        return encode_png(image, meta)

    async def scenario(engine):
        requests = [
            ImageRequest(prompt=p, seed=s) for s, p in enumerate(["一只熊猫", f"番茄{BAD_PNG}", "香蕉"])
        ]
        return await asyncio.gather(*(engine.generate(r) for r in requests), return_exceptions=True)

    _, (good, bad, other) = run_engine(
        quick(max_batch=4, max_wait_ms=0), builtin_pipe, scenario, calls=calls, encoder=encoder
    )
    assert [c[0] for c in calls] == [["一只熊猫", f"番茄{BAD_PNG}", "香蕉"]]  # one batch, sampled once
    assert isinstance(bad, ApiError) and bad.status == 500 and "injected encoder failure" in bad.message
    assert good[0].seed == 0 and other[0].seed == 2
    assert good[0].png.startswith(b"\x89PNG") and other[0].png.startswith(b"\x89PNG")


def test_request_checks_do_not_unpad_the_workers_batch(builtin_pipe):
    """Request checks count tokens on the event loop while the worker encodes a batch. A fast
    tokenizer sets padding on its shared backend per call, so with one tokenizer between them the
    worker's rows came back unpadded now and then (CI: "Unable to create tensor"). A tiny GIL switch
    interval makes the interleaving happen within a few hundred calls."""
    import sys

    limits = model_limits(builtin_pipe, quick())
    prompts = ["一个红色的番茄", "绿色背景上有一个很大很大的番茄和一根香蕉"]
    errors: list[BaseException] = []
    done = threading.Event()

    def worker() -> None:
        try:
            for _ in range(1500):
                builtin_pipe.text_encoder.tokenize(prompts)
        except BaseException as err:  # handed to the test thread
            errors.append(err)
        finally:
            done.set()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        thread = threading.Thread(target=worker)
        thread.start()
        while not done.is_set():
            limits.count_tokens("一个红色的番茄很长很长")
        thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[0]
