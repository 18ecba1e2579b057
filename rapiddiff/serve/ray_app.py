"""The same app on Ray Serve: ``rapiddiff serve --ray`` (``pip install 'rapiddiff[ray]'``).

Every replica builds the app ``rapiddiff serve`` runs (:func:`rapiddiff.serve.app.create_app`)
with its own engine, on the GPU share Ray gives it (``1 / replicas_per_gpu``); Ray Serve's proxy
spreads requests over the replicas and its autoscaler keeps ``target_ongoing_requests`` in flight
per replica, between ``min_replicas`` and ``max_replicas``.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Any

from rapiddiff.serve.app import create_app
from rapiddiff.serve.config import ServeConfig
from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)


def _require_ray() -> Any:
    try:
        from ray import serve
    except ImportError as err:
        raise RuntimeError(
            "--ray needs Ray Serve: pip install 'rapiddiff[ray]' (or pip install 'ray[serve]')"
        ) from err
    return serve


# Ray Serve kills its HTTP proxy when the proxy is not ready within 5 s (then 10 s, ...) and
# serve.start fails with "ActorDiedError ... killed by ray.kill": on a busy 2-core machine the
# proxy's imports alone take longer. Patient defaults for a Ray that this process starts (its
# processes inherit the environment); a value the user set wins.
PATIENT_PROXY_ENV = {
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
}


def patient_proxy_env() -> None:
    """Set :data:`PATIENT_PROXY_ENV` where the user has not: call before ``ray.init`` starts Ray."""
    for name, value in PATIENT_PROXY_ENV.items():
        os.environ.setdefault(name, value)


def build_deployment(
    config: ServeConfig,
    *,
    gpus: bool,
    replicas_per_gpu: int = 1,
    min_replicas: int = 1,
    max_replicas: int = 1,
    target_ongoing_requests: float = 8,
) -> Any:
    """A bound Ray Serve application: the rapiddiff app behind ``serve.ingress``, autoscaled."""
    serve = _require_ray()
    if replicas_per_gpu < 1:
        raise ValueError(f"--replicas-per-gpu must be ≥ 1, got {replicas_per_gpu}")
    if not 1 <= min_replicas <= max_replicas:
        raise ValueError(f"need 1 ≤ --min-replicas ({min_replicas}) ≤ --max-replicas ({max_replicas})")
    if len(config.devices) != 1 or config.devices[0] not in ("auto", "cpu", "cuda", "cuda:0"):
        raise ValueError("--ray: Ray gives each replica its device; drop --devices (one copy per replica)")
    # Each replica sees only the GPU Ray gave it: its "auto" device is that GPU (or the CPU).
    replica_config = replace(config, devices=["auto" if gpus else "cpu"])

    def build_app() -> Any:  # Ray calls a plain function (not a partial) in each replica
        return create_app(replica_config)

    deployment = serve.deployment(serve.ingress(build_app)())
    autoscaling = {
        "min_replicas": min_replicas,
        "max_replicas": max_replicas,
        "target_ongoing_requests": target_ongoing_requests,
    }
    options: dict[str, Any] = {
        "name": "rapiddiff",
        "ray_actor_options": {"num_gpus": 1 / replicas_per_gpu if gpus else 0, "num_cpus": 1},
        # Enough in flight to fill batches; beyond it Ray queues in its proxy (back-pressure).
        "max_ongoing_requests": max(2 * config.max_batch, int(2 * target_ongoing_requests)),
        "graceful_shutdown_timeout_s": 600,  # the app finishes its queue before a replica goes
        "health_check_period_s": 10,
    }
    if min_replicas == max_replicas:
        options["num_replicas"] = min_replicas
    else:
        options["autoscaling_config"] = autoscaling
    return deployment.options(**options).bind()


def run_ray(
    config: ServeConfig,
    *,
    host: str,
    port: int,
    address: str | None = None,
    replicas_per_gpu: int = 1,
    min_replicas: int = 1,
    max_replicas: int = 1,
    target_ongoing_requests: float = 8,
) -> int:
    """Connect to (or start) Ray, deploy the app, and serve until interrupted."""
    serve = _require_ray()
    import ray

    if address is None:  # Ray started here: its processes take this environment
        patient_proxy_env()
    ray.init(address=address, ignore_reinit_error=True)
    gpus = ray.cluster_resources().get("GPU", 0) > 0 and config.devices != ["cpu"]
    app = build_deployment(
        config,
        gpus=gpus,
        replicas_per_gpu=replicas_per_gpu,
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        target_ongoing_requests=target_ongoing_requests,
    )
    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name="rapiddiff", route_prefix="/")
    print(f"rapiddiff serve --ray: http://{host}:{port}/ (Ray dashboard lists the replicas)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()  # replicas run their lifespan shutdown: queued requests finish first
    return 0
