"""Small clients of a KServe v2 server (converge's or Triton's): sync and async, numpy in and out.

    with Client("http://127.0.0.1:8000", token=...) as c:
        out = c.infer("gw-run", {"strain": windows})   # {"logit": ..., "probability": ...}
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import httpx
import numpy as np

from .protocol import HEADER_LENGTH, decode_infer_response, encode_infer_request


class ServerError(RuntimeError):
    """A non-2xx answer: ``status`` and the server's message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message = status, message


def _check(response: httpx.Response) -> httpx.Response:
    if response.is_success:
        return response
    try:
        message = response.json().get("error", response.text)
    except ValueError:
        message = response.text
    raise ServerError(response.status_code, message)


def _infer_path(model: str, version: str | None) -> str:
    return f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"


def _headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


class Client:
    """Synchronous client; ``binary=True`` sends and receives tensors as raw bytes (no JSON number parsing)."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 60.0, **httpx_options: Any) -> None:
        self._http = httpx.Client(base_url=url, headers=_headers(token), timeout=timeout, **httpx_options)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def live(self) -> bool:
        return self._http.get("/v2/health/live").status_code == 200

    def ready(self, model: str | None = None) -> bool:
        path = f"/v2/models/{model}/ready" if model else "/v2/health/ready"
        return self._http.get(path).status_code == 200

    def server_metadata(self) -> dict:
        return _check(self._http.get("/v2")).json()

    def metadata(self, model: str, version: str | None = None) -> dict:
        path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "")
        return _check(self._http.get(path)).json()

    def infer(self, model: str, inputs: Mapping[str, np.ndarray], binary: bool = True,
              outputs: Sequence[str] | None = None, version: str | None = None) -> dict[str, np.ndarray]:
        """Outputs by name for ``inputs`` (arrays with the batch axis first)."""
        body, headers = encode_infer_request({k: np.asarray(v) for k, v in inputs.items()}, binary, outputs)
        response = _check(self._http.post(_infer_path(model, version), content=body, headers=headers))
        return decode_infer_response(response.content, response.headers.get(HEADER_LENGTH))


class AsyncClient:
    """The asyncio twin of :class:`Client`."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 60.0, **httpx_options: Any) -> None:
        self._http = httpx.AsyncClient(base_url=url, headers=_headers(token), timeout=timeout, **httpx_options)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def live(self) -> bool:
        return (await self._http.get("/v2/health/live")).status_code == 200

    async def ready(self, model: str | None = None) -> bool:
        path = f"/v2/models/{model}/ready" if model else "/v2/health/ready"
        return (await self._http.get(path)).status_code == 200

    async def server_metadata(self) -> dict:
        return _check(await self._http.get("/v2")).json()

    async def metadata(self, model: str, version: str | None = None) -> dict:
        path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "")
        return _check(await self._http.get(path)).json()

    async def infer(self, model: str, inputs: Mapping[str, np.ndarray], binary: bool = True,
                    outputs: Sequence[str] | None = None, version: str | None = None) -> dict[str, np.ndarray]:
        body, headers = encode_infer_request({k: np.asarray(v) for k, v in inputs.items()}, binary, outputs)
        response = _check(await self._http.post(_infer_path(model, version), content=body, headers=headers))
        return decode_infer_response(response.content, response.headers.get(HEADER_LENGTH))
