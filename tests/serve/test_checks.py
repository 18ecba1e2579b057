"""Request checks and the app's own pages, without a model: sizes, OpenAI's extra fields, defaults,
a model that fails to load, the offline API docs."""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from rapiddiff.models.builtin import default_builtin
from rapiddiff.models.sampling import SamplingDefaults
from rapiddiff.serve import cli as serve_cli
from rapiddiff.serve.app import create_app
from rapiddiff.serve.config import ServeConfig, parse_size
from rapiddiff.serve.engine import Engine, served_model_aliases, served_model_name
from rapiddiff.serve.schemas import ApiError, ImageRequest, ModelLimits, check_request


def limits(**overrides: object) -> ModelLimits:
    """A model's limits as model_limits reads them, for a 128² model of multiples of 32."""
    fields: dict = {
        "name": "builtin:kshapes",
        "default_size": 128,
        "size_multiple": 32,
        "max_tokens": 32,
        "schedulers": ("pndm", "ddim", "dpm++"),
        "has_upscaler": False,
        "defaults": SamplingDefaults(num_inference_steps=25, guidance_scale=3.0, scheduler="pndm"),
        "pipeline_kwargs": frozenset({"init_image", "mask_image", "strength"}),
        "count_tokens": lambda text: len(text) + 2,
    }
    return ModelLimits(**{**fields, **overrides})


def check(**fields: object) -> tuple:
    return check_request(ImageRequest(prompt="一只熊猫", **fields), limits(), ServeConfig())


def test_size_is_width_by_height_as_openais():
    settings, _ = check(size="256x128")
    assert (settings.width, settings.height) == (256, 128)
    assert parse_size("96") == (96, 96) and parse_size(" 64 × 32 ") == (64, 32)


@pytest.mark.parametrize("size", ["128by128", "x128", "128x", ""])
def test_a_size_in_another_form_is_a_400_that_shows_the_form(size):
    with pytest.raises(ApiError) as caught:
        check(size=size)
    err = caught.value
    assert (err.status, err.param, err.code) == (400, "size", "invalid_size")
    assert "WIDTHxHEIGHT" in err.message and "width first" in err.message


def test_a_size_off_the_models_grid_names_the_form_and_the_nearest():
    with pytest.raises(ApiError, match=r"\(WIDTHxHEIGHT\).*multiples of 32.*nearest: 96x128"):
        check(size="100x128")


def test_openai_quality_and_style_are_accepted_ignored_and_noted(caplog):
    plain, _ = check()
    with caplog.at_level(logging.INFO, logger="rapiddiff"):
        noted, _ = check(quality="hd", style="vivid")
    assert noted == plain  # no effect on what is sampled
    assert "quality='hd'" in caplog.text and "style='vivid'" in caplog.text and "ignored" in caplog.text


def test_defaults_come_from_the_models_sampling_defaults():
    settings, _ = check()
    assert (settings.steps, settings.guidance, settings.scheduler) == (25, 3.0, "pndm")
    ddim = limits(defaults=SamplingDefaults(num_inference_steps=7, guidance_scale=1.5, scheduler="ddim"))
    settings, _ = check_request(ImageRequest(prompt="x"), ddim, ServeConfig())
    assert (settings.steps, settings.guidance, settings.scheduler) == (7, 1.5, "ddim")


def test_warmup_size_takes_the_apis_width_by_height():
    parser = argparse.ArgumentParser()
    serve_cli.register(parser)
    config = serve_cli.config_from_args(
        parser.parse_args(["--warmup-size", "256x128", "--warmup-size", "64"])
    )
    assert config.warmup_sizes == [(128, 256), (64, 64)]  # (height, width), as the pipeline takes them
    with pytest.raises(SystemExit):
        parser.parse_args(["--warmup-size", "big"])


def test_the_served_model_is_named_by_its_folder_or_builtin():
    default = f"builtin:{default_builtin()}"
    assert served_model_name(ServeConfig()) == served_model_name(ServeConfig(model="builtin")) == default
    assert served_model_name(ServeConfig(model="builtin:kshapes")) == "builtin:kshapes"
    # "builtin", the id before the built-in models had names, still names the default one
    assert served_model_aliases(ServeConfig()) == ("builtin",)
    assert served_model_aliases(ServeConfig(model=Path("runs/kshapes-model"))) == ()
    assert served_model_name(ServeConfig(model=Path("runs/kshapes-model"))) == "kshapes-model"
    assert served_model_name(ServeConfig(model=Path("runs/kshapes-model/"))) == "kshapes-model"


def test_a_request_may_name_the_model_by_an_alias():
    with pytest.raises(ApiError) as err:
        check_request(ImageRequest(prompt="x", model="builtin"), limits(), ServeConfig())
    assert err.value.status == 404 and "builtin:kshapes" in str(err.value)
    check_request(ImageRequest(prompt="x", model="builtin"), limits(aliases=("builtin",)), ServeConfig())


def test_a_model_that_fails_to_load_fails_health_with_the_reason():
    def loader(config, device):
        raise FileNotFoundError("model folder /nowhere/model not found")

    engine = Engine(ServeConfig(devices=["cpu"]), loader=loader)
    with TestClient(create_app(engine=engine)) as client:
        deadline = time.monotonic() + 30
        while (health := client.get("/health")).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert health.status_code == 503
        assert health.json()["status"] == "failed" and "/nowhere/model" in health.json()["error"]
        assert client.get("/ready").status_code == 500
        # Every request that needs the model says why it cannot be served, and the server keeps answering.
        for response in (
            client.get("/v1/settings"),
            client.post("/v1/images/generations", json={"prompt": "一只熊猫"}),
            client.post("/v1/link", json={"prompt": "一只熊猫"}),
        ):
            assert response.status_code == 503
            error = response.json()["error"]
            assert error["code"] == "model_failed" and "/nowhere/model" in error["message"]
        assert client.get("/metrics").status_code == 200


def test_health_answers_ok_while_the_model_loads():
    engine = Engine(ServeConfig(devices=["cpu"]))
    client = TestClient(create_app(engine=engine))  # no lifespan: the model never starts loading
    assert client.get("/health").json() == {"status": "loading"}
    assert client.get("/health").status_code == 200 and client.get("/ready").status_code == 503


def test_api_docs_work_offline():
    client = TestClient(create_app(engine=Engine(ServeConfig(devices=["cpu"]))))
    for page, script in (("/docs", "swagger-ui-bundle.js"), ("/redoc", "redoc.standalone.js")):
        html = client.get(page).text
        assert "http://" not in html and "https://" not in html, html  # nothing from a CDN
        src = next(
            part.split('"')[0] for part in html.split('src="')[1:] if part.split('"')[0].endswith(script)
        )
        asset = client.get(src)
        assert asset.status_code == 200 and len(asset.content) > 100_000, src
    assert "/v1/images/generations" in client.get("/openapi.json").json()["paths"]
