"""rapiddiff serve against a live server: the openai client, plain httpx, errors, batching, CLI parity."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import httpx
import numpy as np
import pytest
from PIL import Image

from rapiddiff.cli import main as cli_main

from .conftest import MODEL, metric

PROMPTS = ["蓝色背景上有一个番茄", "一只熊猫", "红色的圆形", "绿色背景上有一个香蕉"]


def png_meta(data: bytes) -> dict:
    with Image.open(io.BytesIO(data)) as image:
        return json.loads(image.text["rapiddiff"])


def cli_pngs(tmp_path, name: str, *args: str) -> list[bytes]:
    """`rapiddiff generate` with the server's defaults (2 steps, no upscale); the PNGs' bytes in order."""
    out = tmp_path / name
    flags = [
        "--model",
        MODEL,
        "--steps",
        "2",
        "--no-upscale",
        "--no-grid",
        "--no-progress",
        "--out",
        str(out),
    ]
    code = cli_main(["generate", *args, *flags])
    assert code == 0
    return [p.read_bytes() for p in sorted(out.glob("*.png"))]


def test_openai_client_works_unchanged(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="not-needed", timeout=120, max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL]  # the built-in model's name, not "model"
    result = client.images.generate(
        prompt="蓝色背景上有一个番茄", n=2, size="128x128", response_format="b64_json"
    )
    assert len(result.data) == 2
    seeds = []
    for item in result.data:
        data = base64.b64decode(item.b64_json)
        with Image.open(io.BytesIO(data)) as image:
            assert image.format == "PNG" and image.size == (128, 128)
        meta = png_meta(data)
        assert meta["prompt"] == "蓝色背景上有一个番茄" and meta["steps"] == 2 and meta["upscale"] is False
        seeds.append(meta["seed"])
    assert seeds[1] == seeds[0] + 1  # image k gets seed + k, as `rapiddiff generate --num-images`
    # Errors arrive as the client's own exception types, with our message.
    with pytest.raises(openai.BadRequestError, match="multiples of 32"):
        client.images.generate(prompt="x", size="100x100", response_format="b64_json")
    # rapiddiff's own fields ride in extra_body.
    other = client.images.generate(
        prompt="一只熊猫",
        response_format="b64_json",
        extra_body={"seed": 3, "knowledge": False, "guidance": 1.0},
    )
    meta = png_meta(base64.b64decode(other.data[0].b64_json))
    assert (meta["seed"], meta["knowledge"], meta["guidance"]) == (3, False, 1.0)
    spelled = client.images.generate(
        prompt=PROMPTS[0],
        size="128x128",
        response_format="b64_json",
        extra_body={"seed": 3, "knowledge": "text"},
    )
    meta = png_meta(base64.b64decode(spelled.data[0].b64_json))
    assert (meta["knowledge"], meta["knowledge_mode"]) == (True, "text")
    # OpenAI's quality and style mean nothing for this model: accepted and ignored, not refused.
    styled = client.images.generate(
        prompt="一只熊猫",
        quality="hd",
        style="vivid",
        response_format="b64_json",
        extra_body={"seed": 3, "knowledge": False, "guidance": 1.0},
    )
    assert styled.data[0].b64_json == other.data[0].b64_json  # the same image as without them


def test_httpx_image_is_the_clis_image_byte_for_byte(server, tmp_path):
    body = {"prompt": PROMPTS[0], "seed": 11, "n": 2, "negative_prompt": "模糊", "scheduler": "ddim"}
    response = httpx.post(f"{server}/v1/images/generations", json=body, timeout=120)
    assert response.status_code == 200, response.text
    served = [base64.b64decode(item["b64_json"]) for item in response.json()["data"]]
    assert [item["seed"] for item in response.json()["data"]] == [11, 12]
    # The CLI with the same prompt, seed and settings, and the same batch (the request's 2 images).
    cli = cli_pngs(
        tmp_path,
        "cli",
        PROMPTS[0],
        "--seed",
        "11",
        "--num-images",
        "2",
        "--negative",
        "模糊",
        "--scheduler",
        "ddim",
    )
    assert served == cli  # the whole files: pixels and metadata chunks


def test_health_ready_models_settings_link(server):
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server}/ready").json()["status"] == "ready"
    assert httpx.get(f"{server}/v1/models").json()["data"][0]["id"] == MODEL
    settings = httpx.get(f"{server}/v1/settings").json()
    assert settings["model"] == MODEL
    assert settings["size_multiple"] == 32 and settings["defaults"]["steps"] == 2
    linked = httpx.post(f"{server}/v1/link", json={"prompt": "蓝色背景上有一个番茄"}).json()
    assert [(s["surface"], s["start"], s["end"]) for s in linked["spans"]] == [
        ("蓝色", 0, 2),
        ("番茄", 8, 10),
    ]
    tomato = linked["spans"][1]
    assert tomato["entity"] == "番茄" and "颜色: 红色" in tomato["facts"]
    assert "<textarea" in httpx.get(f"{server}/").text


TINY_PNG = base64.b64encode(b"not a png at all").decode()
BAD = {
    "size not a multiple": ({"size": "100x128"}, 400, "invalid_size"),
    "size too large": ({"size": "2048x2048"}, 400, "invalid_size"),
    "size in another form": ({"size": "128 by 128"}, 400, "invalid_size"),
    "too many images": ({"n": 5}, 400, "too_many_images"),
    "too many steps": ({"steps": 101}, 400, "too_many_steps"),
    "no steps": ({"steps": 0}, 400, "invalid_value"),
    "prompt too long": ({"prompt": "番茄" * 40}, 400, "prompt_too_long"),
    "prompt far too long": ({"prompt": "x" * 100_000}, 400, "prompt_too_long"),
    "unknown field": ({"num_images": 2}, 400, "unknown_field"),
    "bad base64": ({"init_image": "%%%not base64%%%"}, 400, "invalid_base64"),
    "base64 of a non-image": ({"init_image": TINY_PNG}, 400, "invalid_image"),
    "wrong type": ({"n": "two"}, 400, "invalid_value"),
    "unknown scheduler": ({"scheduler": "euler-x"}, 400, None),
    "url response": ({"response_format": "url"}, 400, "unsupported_response_format"),
    "unknown model": ({"model": "dall-e-3"}, 404, "model_not_found"),
    "empty prompt": ({"prompt": "   "}, 400, None),
}


@pytest.mark.parametrize("case", list(BAD))
def test_each_bad_request_gets_its_4xx_and_the_server_keeps_serving(server, case):
    fields, status, code = BAD[case]
    response = httpx.post(
        f"{server}/v1/images/generations", json={"prompt": "一只熊猫", **fields}, timeout=60
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if code:
        assert error["code"] == code
    assert httpx.get(f"{server}/health").status_code == 200


def test_malformed_bodies_are_400(server):
    url = f"{server}/v1/images/generations"
    not_json = httpx.post(url, content=b"{prompt: oops", headers={"Content-Type": "application/json"})
    assert not_json.status_code == 400 and not_json.json()["error"]["code"] == "invalid_json"
    missing = httpx.post(url, json={"n": 1})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "prompt"
    assert httpx.post(url, json=["a list"]).status_code == 400


def test_concurrent_requests_are_batched_and_keep_their_seeds(server, tmp_path):
    before = httpx.get(f"{server}/metrics").text

    async def send_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=180) as client:
            # A request of another size (it cannot join them) keeps the one worker busy, so the four
            # queue together behind it. (Sent to an idle server, the first of them would run at once,
            # alone: the server does not hold a lone request back in case others follow.)
            pacer = asyncio.create_task(
                client.post(
                    f"{server}/v1/images/generations",
                    json={"prompt": "一只熊猫", "size": "96x96", "steps": 20, "seed": 1},
                )
            )
            for _ in range(600):  # bounded: until the worker samples the pacer
                if metric((await client.get(f"{server}/metrics")).text, "rapiddiff_workers_busy") >= 1:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the pacer never started sampling")
            calls = [
                client.post(f"{server}/v1/images/generations", json={"prompt": p, "seed": 100 + i})
                for i, p in enumerate(PROMPTS)
            ]
            responses = await asyncio.wait_for(asyncio.gather(*calls), timeout=240)
            assert (await pacer).status_code == 200
            return responses

    responses = asyncio.run(send_all())
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    served = [base64.b64decode(r.json()["data"][0]["b64_json"]) for r in responses]
    after = httpx.get(f"{server}/metrics").text
    # The pacer alone, then one pipeline call of 4 images served the 4 requests.
    calls = metric(after, "rapiddiff_batch_size_count") - metric(before, "rapiddiff_batch_size_count")
    images = metric(after, "rapiddiff_batch_size_sum") - metric(before, "rapiddiff_batch_size_sum")
    assert (calls, images) == (2, 5)
    for bound, batches in (("1", 1), ("2", 1), ("4", 2)):
        name = f'rapiddiff_batch_size_bucket{{le="{bound}"}}'
        assert metric(after, name) - metric(before, name) == batches, bound
    assert metric(after, 'rapiddiff_requests_total{endpoint="generations",status="200"}') >= 4

    # Each is the CLI's image for its prompt and seed: byte for byte when the CLI samples the same
    # four together (seeds 100..103 in one batch of 4) ...
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS), encoding="utf-8")
    together = cli_pngs(tmp_path, "together", "--prompts", str(prompts), "--seed", "100", "--batch-size", "4")
    assert served == together
    # ... and, sampled one at a time, the same image up to CPU float rounding in a batch of another
    # size (BLAS kernels sum in a batch-size-dependent order: at most 1 level, on few pixels).
    alone = cli_pngs(tmp_path, "alone", "--prompts", str(prompts), "--seed", "100", "--batch-size", "1")
    for a, b in zip(served, alone, strict=True):
        x = np.asarray(Image.open(io.BytesIO(a)), dtype=int)
        y = np.asarray(Image.open(io.BytesIO(b)), dtype=int)
        assert np.abs(x - y).max() <= 1 and (x != y).mean() < 0.01
        assert png_meta(a) == png_meta(b)


def test_metrics_are_prometheus_text(server):
    text = httpx.get(f"{server}/metrics").text
    for name in (
        "rapiddiff_requests_total",
        "rapiddiff_queue_depth",
        "rapiddiff_batch_size",
        "rapiddiff_request_latency_seconds",
        "rapiddiff_request_latency_quantile_seconds",
    ):
        assert f"# TYPE {name} " in text
    assert metric(text, 'rapiddiff_queue_depth{unit="images"}') == 0
    assert metric(text, "rapiddiff_ready") == 1
    p50 = metric(text, 'rapiddiff_request_latency_quantile_seconds{quantile="0.5"}')
    p95 = metric(text, 'rapiddiff_request_latency_quantile_seconds{quantile="0.95"}')
    assert 0 < p50 <= p95


def test_img2img_and_inpainting_run_through_the_served_pipeline(server):
    """init_image / mask_image / strength reach the pipeline: the PNG records the task and its
    strength, and the image is not the text-only one for the same seed."""
    canvas = Image.new("RGB", (128, 128), (200, 40, 40))
    mask = Image.new("L", (128, 128), 0)
    mask.paste(255, (32, 32, 96, 96))

    def b64(image: Image.Image) -> str:
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return base64.b64encode(buf.getvalue()).decode()

    url = f"{server}/v1/images/generations"
    base = {"prompt": PROMPTS[0], "seed": 5, "size": "128x128"}
    text_only = httpx.post(url, json=base, timeout=120).json()["data"][0]["b64_json"]
    for extra in (
        {"init_image": b64(canvas), "strength": 0.6},
        {"init_image": b64(canvas), "mask_image": b64(mask)},
    ):
        response = httpx.post(url, json={**base, **extra}, timeout=120)
        assert response.status_code == 200, response.text
        data = response.json()["data"][0]["b64_json"]
        meta = png_meta(base64.b64decode(data))
        assert meta["task"] == ("inpaint" if "mask_image" in extra else "img2img"), meta
        assert data != text_only
