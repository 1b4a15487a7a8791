"""The peers' side of the serving benchmark: the code Triton, MLServer and LitServe run, in their own environments.

Each calls our model exactly as our server does (``load_served_model(run).predict``, on the run's precision and
one torch thread per worker); only the server around it differs. See :mod:`.peers` for setting them up and
measuring them.

- :class:`TritonPythonModel`: a model of Triton's Python backend (the repository's ``model.py`` imports it);
  Triton's dynamic batcher hands ``execute`` the requests it gathered, which it concatenates on axis 0,
  predicts at once and splits back (:func:`triton_execute`), one instance per ``instance_group`` count.
- :class:`MLServerRuntime`: an MLServer ``MLModel``; MLServer's adaptive batcher merges V2 requests into one
  (inputs concatenated on axis 0) and splits the answer; ``predict`` decodes to numpy, predicts, encodes.
- :class:`LitServeAPI`: a LitServe ``LitAPI``, decode (one sample) -> batch -> predict -> unbatch -> encode;
  :func:`serve_litserve` runs it (``python -m converge.bench.peer_runtimes litserve RUN --port P``).

mlserver, litserve and Triton's ``triton_python_backend_utils`` import only in the peers' environments, so the
classes are built on first access (the module's ``__getattr__``), once: LitServe pickles the API into a spawned
worker, and pickle checks the class it finds by name is the one it has.
"""
from __future__ import annotations

import argparse
import json
import sys
from functools import cache
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from .peer_wire import (array_from_v2, concat_samples, decode_litserve_request, split_by_sizes, split_samples,
                        v2_tensor)

MODULE = "converge.bench.peer_runtimes"  # by name: run with -m this module is __main__, the workers import it


def load_model_for_peer(run_dir: str, threads: int):
    """Our served model, as our server loads it, on ``threads`` torch threads."""
    import torch

    from ..serve.registry import load_served_model

    torch.set_num_threads(threads)
    return load_served_model(run_dir)


def triton_execute(predict, requests: Sequence[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """One answer per request of the batch Triton gathered: the requests' inputs concatenated, ``predict``ed at
    once, split back by each request's own batch size."""
    sizes = [len(next(iter(r.values()))) for r in requests]
    return split_by_sizes(predict(concat_samples(requests)), sizes)


@cache
def _triton_model() -> type:
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        """Triton's Python-backend contract: ``initialize`` loads our model, ``execute`` answers a batch."""

        def initialize(self, args: dict) -> None:
            params = json.loads(args["model_config"]).get("parameters", {})
            self.model = load_model_for_peer(params["run"]["string_value"], int(params["threads"]["string_value"]))
            self.inputs = [s.name for s in self.model.inputs]

        def execute(self, requests: list) -> list:
            arrays = [{n: pb_utils.get_input_tensor_by_name(r, n).as_numpy() for n in self.inputs} for r in requests]
            return [pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in answer.items()])
                    for answer in triton_execute(self.model.predict, arrays)]

    TritonPythonModel.__module__, TritonPythonModel.__qualname__ = MODULE, "TritonPythonModel"
    return TritonPythonModel


@cache
def _mlserver_runtime() -> type:
    from mlserver import MLModel
    from mlserver.types import InferenceRequest, InferenceResponse, ResponseOutput

    class MLServerRuntime(MLModel):
        """Decode the (adaptively batched) V2 request, ``predict``, encode each output with its own shape."""

        async def load(self) -> bool:
            extra = self.settings.parameters.extra
            self._model = load_model_for_peer(extra["run"], int(extra["threads"]))
            return True

        async def predict(self, payload: InferenceRequest) -> InferenceResponse:
            inputs = {x.name: array_from_v2(x.data.root, x.datatype, x.shape) for x in payload.inputs}
            outputs = self._model.predict(inputs)
            return InferenceResponse(model_name=self.name, id=payload.id,
                                     outputs=[ResponseOutput(**v2_tensor(k, v)) for k, v in outputs.items()])

    MLServerRuntime.__module__, MLServerRuntime.__qualname__ = MODULE, "MLServerRuntime"
    return MLServerRuntime


@cache
def _litserve_api() -> type:
    import litserve as ls

    class LitServeAPI(ls.LitAPI):
        """decode (one sample) -> batch (concatenate) -> predict -> unbatch (rows) -> encode (v2 JSON outputs)."""

        def __init__(self, run_dir: str, threads: int, max_batch_size: int, batch_timeout_s: float) -> None:
            super().__init__(max_batch_size=max_batch_size, batch_timeout=batch_timeout_s)
            self.run_dir, self.threads = run_dir, threads

        def setup(self, device: str) -> None:
            self.model = load_model_for_peer(self.run_dir, self.threads)
            self.datatypes = {s.name: s.datatype for s in self.model.inputs}

        def decode_request(self, request: dict) -> dict[str, np.ndarray]:
            return decode_litserve_request(request, self.datatypes)

        def batch(self, inputs: list) -> dict[str, np.ndarray]:
            return concat_samples(inputs)

        def predict(self, x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            return self.model.predict(x)

        def unbatch(self, output: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
            return split_samples(output)

        def encode_response(self, output: dict[str, np.ndarray]) -> dict:
            return {"outputs": [v2_tensor(k, v) for k, v in output.items()]}

    LitServeAPI.__module__, LitServeAPI.__qualname__ = MODULE, "LitServeAPI"
    return LitServeAPI


def __getattr__(name: str) -> type:
    """The runtime classes, built on first access: their servers live only in the peers' environments. Built
    once (pickle, which LitServe's spawned worker needs, checks that the class it finds is the one it has)."""
    if name == "MLServerRuntime":
        return _mlserver_runtime()
    if name == "LitServeAPI":
        return _litserve_api()
    if name == "TritonPythonModel":
        return _triton_model()
    raise AttributeError(f"module {MODULE!r} has no attribute {name!r}")


def serve_litserve(run_dir: str, port: int, max_batch_size: int, batch_timeout_s: float, threads: int,
                   workers: int = 1) -> None:
    """LitServe on 127.0.0.1:``port``, ``workers`` inference workers on the CPU; blocks until interrupted."""
    import litserve as ls

    from converge.bench.peer_runtimes import LitServeAPI  # by name, not __main__: see MODULE

    api = LitServeAPI(str(Path(run_dir).resolve()), threads, max_batch_size, batch_timeout_s)
    # fast_queue: ZeroMQ between the HTTP server and the worker, which LitServe documents "for >100 RPS"
    server = ls.LitServer(api, accelerator="cpu", devices=1, workers_per_device=workers, timeout=60, fast_queue=True)
    server.run(host="127.0.0.1", port=port, num_api_servers=1, generate_client_file=False)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m converge.bench.peer_runtimes litserve RUN --port P [--max-batch-size 64] ...``."""
    parser = argparse.ArgumentParser(prog="python -m converge.bench.peer_runtimes", description=__doc__.split("\n")[0])
    parser.add_argument("server", choices=["litserve"], help="MLServer starts with `mlserver start`, not here")
    parser.add_argument("run", help="a `converge train` run folder")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--batch-timeout", type=float, default=0.001, help="seconds")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each worker")
    parser.add_argument("--workers", type=int, default=1, help="inference worker processes (workers_per_device)")
    args = parser.parse_args(argv)
    serve_litserve(args.run, args.port, args.max_batch_size, args.batch_timeout, args.threads, args.workers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
