"""rapiddiff serve on Ray Serve: a local Ray instance on the CPU, the built-in model."""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import tempfile

import httpx
import pytest
from PIL import Image

from rapiddiff.serve.config import ServeConfig

from .conftest import MODEL, free_port, wait_ready

pytest.importorskip("ray.serve", reason="Ray Serve is optional: pip install 'rapiddiff[ray]'")


@pytest.mark.slow  # starting Ray and a replica takes ~30 s on 2 cores
def test_ray_serve_deployment_answers_like_the_server(tmp_path, monkeypatch):
    import ray
    from ray import serve

    from rapiddiff.serve.ray_app import PATIENT_PROXY_ENV, build_deployment

    # As run_ray does for the Ray it starts (its proxy was killed at 5 s on a loaded machine).
    for name, value in PATIENT_PROXY_ENV.items():
        monkeypatch.setenv(name, value)
    port = free_port()
    # Ray's socket paths must stay under 108 bytes: a short folder, not pytest's deep tmp_path.
    ray_dir = tempfile.mkdtemp(prefix="rd-ray-", dir="/tmp")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        namespace="rapiddiff-test",
        _temp_dir=ray_dir,
        log_to_driver=False,
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = ServeConfig(model=MODEL, default_steps=2, default_upscale=False)
        app = build_deployment(config, gpus=False, min_replicas=1, max_replicas=1)
        serve.run(app, name="rapiddiff", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, timeout=300)
        response = httpx.post(
            f"{url}/v1/images/generations", json={"prompt": "蓝色背景上有一个番茄", "seed": 9}, timeout=120
        )
        assert response.status_code == 200, response.text
        data = base64.b64decode(response.json()["data"][0]["b64_json"])
        with Image.open(io.BytesIO(data)) as image:
            assert image.size == (128, 128)
            meta = json.loads(image.text["rapiddiff"])
        assert (meta["seed"], meta["steps"]) == (9, 2)
        bad = httpx.post(f"{url}/v1/images/generations", json={"prompt": "x", "n": 99}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "too_many_images"
        assert "rapiddiff_batch_size_count 1" in httpx.get(f"{url}/metrics").text
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(ray_dir, ignore_errors=True)


def test_ray_deployment_settings():
    from rapiddiff.serve.ray_app import build_deployment

    with pytest.raises(ValueError, match="drop --devices"):
        build_deployment(ServeConfig(devices=["cuda:0", "cuda:1"]), gpus=True)
    with pytest.raises(ValueError, match="min-replicas"):
        build_deployment(ServeConfig(), gpus=False, min_replicas=3, max_replicas=2)
    app = build_deployment(
        ServeConfig(max_batch=8), gpus=True, replicas_per_gpu=2, min_replicas=1, max_replicas=4
    )
    deployment = app._bound_deployment  # Ray Serve's Application → its Deployment (private, stable since 2.7)
    assert deployment.ray_actor_options["num_gpus"] == 0.5
    assert deployment._deployment_config.autoscaling_config.max_replicas == 4
    assert deployment._deployment_config.max_ongoing_requests == 16


def test_patient_proxy_env_keeps_the_users_values(monkeypatch):
    from rapiddiff.serve.ray_app import PATIENT_PROXY_ENV, patient_proxy_env

    for name in PATIENT_PROXY_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "7")
    patient_proxy_env()
    assert os.environ["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] == "60"
    assert os.environ["RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S"] == "7"
