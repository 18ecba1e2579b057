"""Prometheus text-format metrics, kept by hand (no client library needed for six series).

Updated only from the event loop's thread (the engine hands results back there), so plain
integers suffice; latency quantiles come from a sliding window of the most recent requests.
"""

from __future__ import annotations

import math
from collections import Counter, deque

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)
QUANTILES = (0.5, 0.9, 0.95, 0.99)


def quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile (the value at rank ⌈q·n⌉), NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


class Metrics:
    def __init__(self, window: int = 1024) -> None:
        self.requests: Counter[tuple[str, int]] = Counter()  # (endpoint, status) → count
        self.images = 0
        self.batches = 0
        self.batch_images: Counter[int] = Counter()  # images per pipeline call → count
        self.latency: deque[float] = deque(maxlen=window)  # seconds, successful generation requests
        self.latency_hist: Counter[float] = Counter()
        self.latency_sum = 0.0
        self.queue_wait: deque[float] = deque(maxlen=window)

    def observe_request(self, endpoint: str, status: int, seconds: float | None = None) -> None:
        self.requests[(endpoint, status)] += 1
        if seconds is not None:
            self.latency.append(seconds)
            self.latency_sum += seconds
            for bound in LATENCY_BUCKETS:
                if seconds <= bound:
                    self.latency_hist[bound] += 1

    def observe_batch(self, images: int, waits: list[float]) -> None:
        self.batches += 1
        self.images += images
        self.batch_images[images] += 1
        self.queue_wait.extend(waits)

    def render(
        self, *, queue_images: int, queue_requests: int, busy_workers: int, workers: int, ready: bool
    ) -> str:
        lines: list[str] = []

        def head(name: str, kind: str, text: str) -> None:
            lines.append(f"# HELP {name} {text}")
            lines.append(f"# TYPE {name} {kind}")

        head("rapiddiff_requests_total", "counter", "HTTP requests by endpoint and status code")
        for (endpoint, status), count in sorted(self.requests.items()):
            lines.append(f'rapiddiff_requests_total{{endpoint="{endpoint}",status="{status}"}} {count}')
        head("rapiddiff_images_total", "counter", "images generated")
        lines.append(f"rapiddiff_images_total {self.images}")
        head("rapiddiff_queue_depth", "gauge", "images (and requests) waiting for a worker")
        lines.append(f'rapiddiff_queue_depth{{unit="images"}} {queue_images}')
        lines.append(f'rapiddiff_queue_depth{{unit="requests"}} {queue_requests}')
        head("rapiddiff_workers_busy", "gauge", "workers (one per device) running a batch")
        lines.append(f"rapiddiff_workers_busy {busy_workers}")
        head("rapiddiff_workers", "gauge", "workers (model copies)")
        lines.append(f"rapiddiff_workers {workers}")
        head("rapiddiff_ready", "gauge", "1 once every model copy is loaded (and warmed up)")
        lines.append(f"rapiddiff_ready {int(ready)}")

        head("rapiddiff_batch_size", "histogram", "images per pipeline call")
        cumulative = 0
        for bound in BATCH_BUCKETS:
            cumulative = sum(c for size, c in self.batch_images.items() if size <= bound)
            lines.append(f'rapiddiff_batch_size_bucket{{le="{bound}"}} {cumulative}')
        lines.append(f'rapiddiff_batch_size_bucket{{le="+Inf"}} {self.batches}')
        lines.append(f"rapiddiff_batch_size_sum {self.images}")
        lines.append(f"rapiddiff_batch_size_count {self.batches}")

        name = "rapiddiff_request_latency_seconds"
        head(name, "histogram", "time from a generation request's arrival to its response (successes)")
        for bound in LATENCY_BUCKETS:
            lines.append(f'{name}_bucket{{le="{bound}"}} {self.latency_hist[bound]}')
        total = sum(c for (e, s), c in self.requests.items() if e == "generations" and s == 200)
        lines.append(f'{name}_bucket{{le="+Inf"}} {total}')
        lines.append(f"{name}_sum {self.latency_sum:.6f}")
        lines.append(f"{name}_count {total}")

        for name, values, text in (
            ("rapiddiff_request_latency_quantile_seconds", list(self.latency), "request latency quantiles"),
            ("rapiddiff_queue_wait_quantile_seconds", list(self.queue_wait), "queue wait quantiles"),
        ):
            head(name, "gauge", f"{text} over the last {self.latency.maxlen} requests")
            for q in QUANTILES:
                lines.append(f'{name}{{quantile="{q}"}} {quantile(values, q):.6f}')
        return "\n".join(lines) + "\n"
