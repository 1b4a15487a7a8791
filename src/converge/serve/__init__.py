"""Serve trained surrogates over the Open Inference Protocol (KServe v2) with dynamic batching.

- ``batcher``: the queue, the batch decision (``collect_batch``) and the worker per model;
- ``protocol``: KServe v2 JSON and binary tensors, both directions, and request validation;
- ``registry``: ``ServedModel`` and ``load_served_model(run_dir)``;
- ``app``: ``create_app(models, settings)``, the FastAPI app; ``metrics``: its Prometheus registry;
- ``server``: ``serve(runs, host, port, ...)`` behind ``converge serve``; ``client``: ``Client``/``AsyncClient``.
"""
from .app import ServerSettings, create_app
from .batcher import BatchConfig, Batcher, BatchFailed, QueueFull, RequestTimeout, ShuttingDown
from .client import AsyncClient, Client, ServerError
from .protocol import ValidationError
from .registry import ModelLoadError, ServedModel, load_served_model
from .server import ServeConfigError, serve

__all__ = ["AsyncClient", "BatchConfig", "BatchFailed", "Batcher", "Client", "ModelLoadError", "QueueFull",
           "RequestTimeout", "ServeConfigError", "ServedModel", "ServerError", "ServerSettings", "ShuttingDown",
           "ValidationError", "create_app", "load_served_model", "serve"]
