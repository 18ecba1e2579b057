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
from rapiddiff.serve.engine import Engine, batch_buckets, load_pipeline
from rapiddiff.serve.metrics import quantile
from rapiddiff.serve.schemas import ImageRequest

from .conftest import FAST_FLAGS, metric, serve_in_thread, serve_process

POISON = "💥"


class RecordingPipeline:
    """The real pipeline, recording each call's rows and thread; a prompt with 💥 makes a call fail
    (a fault injected to see that only that request fails, not its batch-mates)."""

    def __init__(self, pipe: object, calls: list) -> None:
        self.pipe, self.calls = pipe, calls

    def __getattr__(self, name: str) -> object:
        return getattr(self.pipe, name)

    def __call__(self, prompts, **kwargs):
        self.calls.append((list(prompts), threading.current_thread().name))
        if any(POISON in p for p in prompts):
            raise RuntimeError("injected failure")
        return self.pipe(prompts, **kwargs)


@pytest.fixture(scope="module")
def recorded():
    """Two model copies on the CPU (two workers), every pipeline call recorded."""
    calls: list = []
    config = ServeConfig(
        devices=["cpu", "cpu"], default_steps=2, default_upscale=False, max_batch=4, max_wait_ms=500
    )

    def loader(cfg, device):
        return RecordingPipeline(load_pipeline(cfg, device), calls)

    engine = Engine(config, loader=loader)
    with serve_in_thread(create_app(engine=engine)) as url:
        yield url, calls


def test_a_failing_request_fails_alone(recorded):
    url, calls = recorded
    calls.clear()

    async def send_all():
        async with httpx.AsyncClient(timeout=180) as client:
            bodies = [
                {"prompt": "一只熊猫", "seed": 1},
                {"prompt": f"番茄{POISON}", "seed": 2},
                {"prompt": "香蕉", "seed": 3},
            ]
            return await asyncio.wait_for(
                asyncio.gather(*(client.post(f"{url}/v1/images/generations", json=b) for b in bodies)), 240
            )

    good, bad, other = asyncio.run(send_all())
    assert good.status_code == 200 and other.status_code == 200
    assert bad.status_code == 500 and bad.json()["error"]["code"] == "generation_failed"
    assert "injected failure" in bad.json()["error"]["message"]
    # The three rode one batch (rows ordered by seed); then each ran alone, and only 💥 failed.
    assert calls[0][0] == ["一只熊猫", f"番茄{POISON}", "香蕉"]
    assert sorted(c[0][0] for c in calls[1:]) == sorted(["一只熊猫", f"番茄{POISON}", "香蕉"])
    assert httpx.get(f"{url}/health").status_code == 200


def test_the_event_loop_answers_while_a_worker_samples(recorded):
    url, _ = recorded

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
    url, calls = recorded
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
            body = {"prompt": "一只熊猫", "seed": seed}
            results.append(httpx.post(f"{url}/v1/images/generations", json=body, timeout=180).status_code)

        threads = [threading.Thread(target=post, args=(s,)) for s in range(3)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while metric(httpx.get(f"{url}/metrics").text, 'rapiddiff_queue_depth{unit="requests"}') < 1:
            assert time.monotonic() < deadline, "nothing queued"
            time.sleep(0.05)
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


def test_fast_batches_are_padded_to_the_warmed_up_sizes():
    """With the fast path, warm-up samples each batch bucket, and a batch of 3 runs padded to 4
    (copies of its last row), its 3 images answered; the pipeline here is the eager one, recorded."""
    calls: list = []
    config = ServeConfig(
        devices=["cpu"], fast=True, max_batch=4, default_steps=1, default_upscale=False, max_wait_ms=500
    )
    eager = load_pipeline(dataclasses.replace(config, fast=False), "cpu")
    engine = Engine(config, loader=lambda cfg, device: RecordingPipeline(eager, calls))

    async def scenario():
        await engine.start()
        try:
            requests = [ImageRequest(prompt="番茄", seed=s, steps=1) for s in (5, 6, 7)]
            return await asyncio.wait_for(asyncio.gather(*(engine.generate(r) for r in requests)), 240)
        finally:
            await engine.close()

    results = asyncio.run(scenario())
    assert [len(c[0]) for c in calls] == [1, 2, 4, 4]  # warm-up of buckets 1, 2, 4; then the batch
    assert [images[0].seed for images in results] == [5, 6, 7]


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
