"""``rapiddiff serve``: an OpenAI-images-compatible HTTP API over the one generation path.

- :mod:`rapiddiff.serve.config`: :class:`ServeConfig`, the server's typed settings and limits.
- :mod:`rapiddiff.serve.schemas`: the request body, checked into pipeline arguments (4xx on bad input).
- :mod:`rapiddiff.serve.engine`: one pipeline per device, the micro-batching queue, the metrics.
- :mod:`rapiddiff.serve.app`: the FastAPI app (API, health, metrics, the web page at ``/``).
- :mod:`rapiddiff.serve.ray_app`: the same app as a Ray Serve deployment (``rapiddiff[ray]``).

Heavy imports (torch, fastapi) happen inside functions, so ``rapiddiff --help`` stays instant.
"""
