"""The FastAPI app: the OpenAI-compatible images API, health, metrics, entity links and the page.

``create_app(config)`` builds an app whose lifespan loads the model in the background (``/health``
answers at once, ``/ready`` once the model is loaded and warmed up) and, on shutdown, finishes
every queued request before the process exits. Ray Serve builds the same app in each replica.
``/docs`` (Swagger UI) and ``/redoc`` work offline; ``/openapi.json`` is the schema.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from fastapi_offline import FastAPIOffline

from rapiddiff import __version__
from rapiddiff.serve.config import ServeConfig
from rapiddiff.serve.engine import Engine
from rapiddiff.serve.schemas import ApiError, ImageRequest, LinkRequest, default_upscale
from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)

ACCEPTED_FIELDS = ", ".join(ImageRequest.model_fields)


def _validation_error(err: RequestValidationError) -> ApiError:
    """pydantic's error list → one OpenAI-style 400 that names the field and the fix."""
    first = err.errors()[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    field = ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        return ApiError(400, f"unknown field '{field}'; accepted fields: {ACCEPTED_FIELDS}", param=field,
                        code="unknown_field")  # fmt: skip
    if kind == "json_invalid":
        return ApiError(400, f"the body is not valid JSON ({first.get('ctx', {}).get('error', first['msg'])})",
                        code="invalid_json")  # fmt: skip
    if kind == "missing":
        return ApiError(400, f"missing field '{field}'", param=field, code="missing_field")
    if kind == "model_attributes_type" or not loc:
        return ApiError(
            400, 'the body must be a JSON object, e.g. {"prompt": "一只熊猫"}', code="invalid_body"
        )
    return ApiError(
        400, f"{field}: {first['msg']} (got {first.get('input')!r})", param=field, code="invalid_value"
    )


def create_app(config: ServeConfig | None = None, *, engine: Engine | None = None) -> FastAPI:
    """The app around ``engine`` (default: a new one for ``config``), which the app's lifespan
    loads in the background and closes (finishing its queue) at shutdown."""
    engine = engine or Engine(config or ServeConfig())
    # /docs and /redoc with Swagger UI and ReDoc served from the package: FastAPI's own load them
    # from a CDN, a blank page offline.
    app = FastAPIOffline(title="rapiddiff serve", version=__version__, lifespan=_lifespan(engine))
    app.state.engine = engine
    _add_error_handlers(app)
    _add_request_counter(app, engine)
    for router in (_page_routes(), _status_routes(engine), _model_routes(engine), _image_routes(engine)):
        app.include_router(router)
    return app


def _lifespan(engine: Engine) -> Any:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(engine.start())  # /health answers while the model loads
        loading.add_done_callback(lambda t: t.cancelled() or t.exception())  # logged by start()
        try:
            yield
        finally:
            if not loading.done():
                loading.cancel()
            await engine.close()

    return lifespan


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        error = _validation_error(err)
        return JSONResponse(error.body(), status_code=error.status)


def _add_request_counter(app: FastAPI, engine: Engine) -> None:
    @app.middleware("http")
    async def _count(request: Request, call_next: Any) -> Any:
        response = await call_next(request)
        route = request.scope.get("route")
        endpoint = getattr(route, "name", None) or "unknown"
        if endpoint != "generations":  # counted with its latency by the endpoint itself
            engine.metrics.observe_request(endpoint, response.status_code)
        return response


def _page_routes() -> APIRouter:
    router = APIRouter()
    # The page is a packaged file: read it once here, not on every GET /.
    page_html = resources.files("rapiddiff.serve").joinpath("page/index.html").read_text(encoding="utf-8")

    @router.get("/", response_class=HTMLResponse, name="page")
    async def page() -> HTMLResponse:
        return HTMLResponse(page_html)

    return router


def _status_routes(engine: Engine) -> APIRouter:
    """Liveness, readiness and Prometheus metrics."""
    router = APIRouter()

    @router.get("/health", name="health")
    async def health() -> JSONResponse:
        """Liveness: 200 while the process serves or is still loading its model (``"ok"`` /
        ``"loading"``); 503 with the reason once loading has failed, so an orchestrator's liveness
        probe restarts it and a person sees why, as TGI's and vLLM's ``/health`` answer 503 when the
        model cannot serve. Whether to send traffic yet is ``/ready``'s answer."""
        if engine.load_error:
            return JSONResponse({"status": "failed", "error": engine.load_error}, status_code=503)
        return JSONResponse({"status": "ok" if engine.ready else "loading"})

    @router.get("/ready", name="ready")
    async def ready() -> JSONResponse:
        """Readiness: 200 once every model copy is loaded and warmed up, 503 while loading, 500
        with the reason when loading failed."""
        if engine.ready:
            return JSONResponse({"status": "ready", "workers": [w.device for w in engine.workers]})
        if engine.load_error:
            return JSONResponse({"status": "failed", "error": engine.load_error}, status_code=500)
        return JSONResponse({"status": "loading"}, status_code=503)

    @router.get("/metrics", response_class=PlainTextResponse, name="metrics")
    async def metrics() -> PlainTextResponse:
        text = engine.metrics.render(
            queue_images=engine.queued_images(),
            queue_requests=len(engine.pending),
            busy_workers=sum(w.busy for w in engine.workers),
            workers=len(engine.workers),
            ready=engine.ready,
        )
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return router


def _model_routes(engine: Engine) -> APIRouter:
    """What is served: the model list, the form's defaults and limits, the knowledge linker."""
    router = APIRouter()

    @router.get("/v1/models", name="models")
    async def models() -> dict[str, Any]:
        limits = engine.limits
        data = []
        if limits is not None:
            data.append({"id": limits.name, "object": "model", "created": 0, "owned_by": "rapiddiff"})
        return {"object": "list", "data": data}

    @router.get("/v1/settings", name="settings")
    async def settings() -> dict[str, Any]:
        """What the page (and a client) needs to fill its form: defaults and limits."""
        limits = engine.loaded_limits()
        cfg = engine.config
        return {
            "model": limits.name,
            "default_size": limits.default_size,
            "size_multiple": limits.size_multiple,
            "max_side": cfg.max_side,
            "max_images": cfg.max_images,
            "max_steps": cfg.max_steps,
            "max_tokens": limits.max_tokens,
            "schedulers": list(limits.schedulers),
            "defaults": {
                "steps": limits.defaults.num_inference_steps,
                "guidance": limits.defaults.guidance_scale,
                "scheduler": limits.defaults.scheduler,
                "upscale": default_upscale(limits, cfg),
            },
            "has_upscaler": limits.has_upscaler,
            "img2img": "init_image" in limits.pipeline_kwargs,
        }

    @router.post("/v1/link", name="link")
    async def link(req: LinkRequest) -> dict[str, Any]:
        """The entities the knowledge linker finds in a prompt (character spans, as the encoder sees them)."""
        engine.loaded_limits()  # 503 while loading
        encoder = engine.workers[0].pipe.text_encoder
        linker, store = getattr(encoder, "linker", None), getattr(encoder, "store", None)
        if linker is None or store is None:
            return {"prompt": req.prompt, "knowledge": False, "spans": []}
        spans = await asyncio.to_thread(linker.link, req.prompt)
        names, relations = store.entity_names, store.relation_names
        out = []
        for span in spans:
            facts = [f"{relations[r]}: {names[t]}" for r, t in store.facts(span.entity_id)]
            out.append({"start": span.start, "end": span.end, "surface": span.surface,
                        "entity_id": span.entity_id, "entity": names[span.entity_id], "facts": facts})  # fmt: skip
        return {"prompt": req.prompt, "knowledge": True, "spans": out}

    return router


def _image_routes(engine: Engine) -> APIRouter:
    """OpenAI's ``POST /v1/images/generations``."""
    router = APIRouter()

    @router.post("/v1/images/generations", name="generations")
    async def generations(req: ImageRequest) -> JSONResponse:
        t0 = time.monotonic()
        try:
            images = await engine.generate(req)
        except ApiError as err:
            engine.metrics.observe_request("generations", err.status)
            raise
        except asyncio.CancelledError:
            engine.metrics.observe_request("generations", 499)  # the client went away
            raise
        # base64 of a few hundred kB is quick, but keep even that off the loop for large batches.
        encoded = await asyncio.to_thread(lambda: [base64.b64encode(im.png).decode("ascii") for im in images])
        settings = images[0].metadata
        body = {
            "created": int(time.time()),
            "data": [
                {"b64_json": b64, "revised_prompt": None, "seed": im.seed, "metadata": im.metadata}
                for b64, im in zip(encoded, images, strict=True)
            ],
            "output_format": "png",
            "size": f"{settings['width']}x{settings['height']}",
        }
        engine.metrics.observe_request("generations", 200, time.monotonic() - t0)
        return JSONResponse(body)

    return router
