"""Shared pieces of the serving tests: a known-answer model and a real uvicorn server on loopback."""
import contextlib
import socket
import threading
import time

import numpy as np
import pytest
import torch

from converge.contract import TensorSpec
from converge.serve import ServedModel

# Integer weights and inputs: every product and sum is exact in float32, so batching cannot change a bit.
WEIGHT = np.array([[1, 2, 3, 4], [-1, 0, 1, 0], [2, -3, 0, 1]], dtype=np.float32)  # (3, 4)
BIAS = np.array([1, -2, 3], dtype=np.float32)


class KnownAnswer(torch.nn.Module):
    """y = x W^T + b and total = sum(y) (returned as float64 through the signature)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        with torch.no_grad():
            self.linear.weight.copy_(torch.from_numpy(WEIGHT))
            self.linear.bias.copy_(torch.from_numpy(BIAS))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.linear(x)  # (B, 3)
        return y, y.sum(1)


class Known:
    inputs = [TensorSpec("x", "FP32", (-1, 4))]
    outputs = [TensorSpec("y", "FP32", (-1, 3)), TensorSpec("total", "FP64", (-1,))]

    def model(self, name: str = "linear", **kw) -> ServedModel:
        return ServedModel.from_module(name, KnownAnswer(), self.inputs, self.outputs, **kw)

    @staticmethod
    def expected(x: np.ndarray) -> dict[str, np.ndarray]:
        y = x.astype(np.float64) @ WEIGHT.T.astype(np.float64) + BIAS
        return {"y": y.astype(np.float32), "total": y.sum(1)}

    @staticmethod
    def sample(i: int, n: int = 1) -> np.ndarray:
        """n distinct integer-valued rows for client i."""
        j = np.arange(n, dtype=np.float32)[:, None]
        return np.concatenate([j * 0 + i, j, -j, j * 0 + (i % 7) - 3], axis=1).astype(np.float32)  # (n, 4)


@pytest.fixture
def known() -> Known:
    return Known()


@contextlib.contextmanager
def _live_server(app, start_timeout: float = 20.0, direct_infer: bool = True):
    """uvicorn on loopback with the HTTP protocol `converge serve` uses (the direct infer path, unless not)."""
    import uvicorn

    from converge.serve.server import http_protocol

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # loopback only, a free port chosen by the OS
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                           http=http_protocol("httptools", direct_infer)))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


@pytest.fixture
def live_server():
    """``with live_server(app) as url:`` runs ``app`` under uvicorn on 127.0.0.1 (``direct_infer=False``: infer
    through the ASGI app)."""
    return _live_server
