"""Prometheus metrics of one server instance (a registry of its own, so apps and tests never collide).

Names follow Triton's where there is one (``nv_inference_request_success`` ->
``converge_inference_requests_total{outcome="success"}``, ``nv_inference_count``
-> ``converge_inference_samples_total``, ``nv_inference_exec_count`` ->
``converge_inference_executions_total``).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .batcher import BatchRecord

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
TIME_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.http = Counter("converge_http_requests", "HTTP requests by route and status",
                            ["method", "route", "status"], registry=r)
        self.requests = Counter("converge_inference_requests", "Inference requests by outcome",
                                ["model", "outcome"], registry=r)
        self.failures = Counter("converge_inference_failures", "Failed inference requests by reason",
                                ["model", "reason"], registry=r)
        self.samples = Counter("converge_inference_samples", "Samples inferred (batch items)", ["model"], registry=r)
        self.executions = Counter("converge_inference_executions", "Model calls (batches run)", ["model"], registry=r)
        self.batch_size = Histogram("converge_batch_size", "Samples per model call", ["model"],
                                    buckets=BATCH_BUCKETS, registry=r)
        self.queue_seconds = Histogram("converge_queue_seconds", "Time a request waited in the queue", ["model"],
                                       buckets=TIME_BUCKETS, registry=r)
        self.compute_seconds = Histogram("converge_compute_seconds", "Time of one model call", ["model"],
                                         buckets=TIME_BUCKETS, registry=r)
        self.queued = Gauge("converge_queue_samples", "Samples waiting in the queue", ["model"], registry=r)
        # trust gate (converge.serve.fallback); reason: uncertainty | out_of_distribution
        self.fallbacks = Counter("converge_fallback_samples", "Untrusted samples sent to the simulator",
                                 ["model", "reason"], registry=r)
        self.fallback_failures = Counter("converge_fallback_failures", "Requests whose simulator fallback failed",
                                         ["model", "reason"], registry=r)  # reason: timeout | simulator_error
        self.untrusted_refusals = Counter("converge_untrusted_refused_samples",
                                          "Untrusted samples refused (no fallback configured)", ["model", "reason"],
                                          registry=r)
        self._children: dict[tuple, object] = {}  # (metric, label values) -> child, see _child

    def batch_observer(self, model: str):
        """A ``Batcher.on_batch`` callback recording into this registry under ``model``."""
        # labels() validates and locks on every call: resolve the children once, not per request
        executions, batch_size = self.executions.labels(model), self.batch_size.labels(model)
        compute_seconds, queue_seconds = self.compute_seconds.labels(model), self.queue_seconds.labels(model)
        samples = self.samples.labels(model)

        def observe(record: BatchRecord) -> None:
            executions.inc()
            batch_size.observe(record.samples)
            compute_seconds.observe(record.compute_s)
            for q in record.queue_s:
                queue_seconds.observe(q)
            if record.error is None:
                samples.inc(record.samples)
        return observe

    def request_done(self, model: str, reason: str | None) -> None:
        """One inference request finished: ``reason`` None for success, else a short failure class."""
        if reason is None:
            self._child(self.requests, model, "success").inc()
        else:
            self._child(self.requests, model, "failure").inc()
            self._child(self.failures, model, reason).inc()

    def fallback(self, model: str, reason: str, samples: int = 1) -> None:
        self._child(self.fallbacks, model, reason).inc(samples)

    def fallback_failed(self, model: str, reason: str) -> None:
        self._child(self.fallback_failures, model, reason).inc()

    def untrusted_refused(self, model: str, reason: str, samples: int = 1) -> None:
        self._child(self.untrusted_refusals, model, reason).inc(samples)

    def http_request(self, method: str, route: str, status: int) -> None:
        """One HTTP request answered (any route, any status)."""
        self._child(self.http, method, route, str(status)).inc()

    def _child(self, metric, *labels: str):
        """``metric.labels(*labels)``, remembered: labels() validates and locks on every call."""
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
