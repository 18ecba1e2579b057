"""Serving with a ControlNet: ``control_image`` (base64, as init_image) with scale and window reaches
the pipeline; a bad image or a server without a ControlNet is a 4xx that says what to send or how to
start the server, and the server keeps serving."""

from __future__ import annotations

import base64
import io
import json
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from rapiddiff.serve.app import create_app
from rapiddiff.serve.config import ServeConfig
from rapiddiff.serve.schemas import ApiError, ImageRequest, check_request
from tests.infer.test_controlnet import write_tiny_controlnet
from tests.serve.test_checks import limits


def b64(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


EDGES = b64(Image.fromarray(np.random.default_rng(0).integers(0, 256, (16, 16, 3), dtype=np.uint8)))


def check(nets: int, **fields: object) -> tuple:
    return check_request(ImageRequest(prompt="一只熊猫", **fields), limits(controlnets=nets), ServeConfig())


def test_control_fields_become_one_spec_per_net():
    settings, extra = check(2, control_image=[EDGES, EDGES], control_scale=[0.5, 1.5], control_end=0.6)
    specs = extra["control"]
    assert [s.controlnet_conditioning_scale for s in specs] == [0.5, 1.5]
    assert [s.control_guidance_end for s in specs] == [0.6, 0.6] and settings.image_key != 0
    assert check(0)[1] == {}


@pytest.mark.parametrize(
    ("nets", "fields", "code", "words"),
    [
        (1, {"control_image": "%%%"}, "invalid_base64", "control_image"),
        (1, {"control_image": base64.b64encode(b"not an image").decode()}, "invalid_image", "control_image"),
        (0, {"control_image": EDGES}, "no_controlnet", "--controlnet"),
        (1, {"control_image": [EDGES, EDGES]}, None, "one per net"),
        (1, {"control_scale": 0.5}, None, "applies to control_image"),
        (
            1,
            {"control_image": EDGES, "control_start": 0.8, "control_end": 0.2},
            None,
            "control_guidance_start",
        ),
        (2, {"control_image": [EDGES, EDGES], "control_scale": [1, 2, 3]}, None, "one per net"),
    ],
)
def test_bad_control_requests_are_400s_that_say_why(nets, fields, code, words):
    with pytest.raises(ApiError) as caught:
        check(nets, **fields)
    assert caught.value.status == 400 and words in caught.value.message
    if code:
        assert caught.value.code == code


def test_served_control_image_and_the_server_keeps_serving(tiny_folders, tmp_path):
    net = write_tiny_controlnet(tmp_path / "net", tiny_folders["clip"] / "unet", seed=0)
    config = ServeConfig(
        model=tiny_folders["clip"], devices=["cpu"], dtype="float32", default_steps=2, controlnets=[str(net)]
    )
    with TestClient(create_app(config)) as client:
        deadline = time.monotonic() + 120
        while client.get("/ready").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        body = {"prompt": "一只熊猫", "seed": 4, "knowledge": False}
        bad = client.post("/v1/images/generations", json={**body, "control_image": "%%%"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "control_image"
        good = client.post(
            "/v1/images/generations", json={**body, "control_image": EDGES, "control_scale": 0.7}
        )
        assert good.status_code == 200, good.text
        plain = client.post("/v1/images/generations", json=body)
        assert plain.status_code == 200
        png = [base64.b64decode(r.json()["data"][0]["b64_json"]) for r in (good, plain)]
        with Image.open(io.BytesIO(png[0])) as image:
            meta = json.loads(image.text["rapiddiff"])
        (control,) = meta["control"]
        assert control["scale"] == 0.7 and control["image"] is None and len(control["image_sha256"]) == 64
        assert control["controlnet"] == str(net.resolve())
        pixels = [np.asarray(Image.open(io.BytesIO(p)).convert("RGB")) for p in png]
        assert not np.array_equal(*pixels)  # the control image did steer the served image
