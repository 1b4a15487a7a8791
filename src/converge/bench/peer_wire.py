"""What goes over the wire to the peers, and how their runtimes batch: pure functions, no peer needed.

KServe v2 JSON tensors (``{"name", "shape", "datatype", "data"}``), the same as our JSON requests, for
MLServer and LitServe; Triton gets our binary requests themselves (:func:`converge.serve.protocol.
encode_infer_request`). The peers' runtimes (:mod:`.peer_runtimes`) import this module inside the peers'
environments: it needs numpy and converge's protocol only.
"""
from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

import numpy as np

from ..serve.protocol import DATATYPES, datatype_of

JSON_HEADERS = (("Content-Type", "application/json"),)


def v2_tensor(name: str, array: np.ndarray) -> dict:
    """A KServe v2 JSON tensor: name, shape, datatype and the data flattened row-major (as our client sends)."""
    array = np.asarray(array)
    return {"name": name, "shape": list(array.shape), "datatype": datatype_of(array.dtype),
            "data": array.reshape(-1).tolist()}


def array_from_v2(data: Any, datatype: str, shape: Sequence[int]) -> np.ndarray:
    """The array of a v2 JSON tensor's parts; a clear error for a datatype or a size that does not fit."""
    if datatype not in DATATYPES:
        raise ValueError(f"datatype {datatype!r}: expected one of {', '.join(DATATYPES)}")
    array = np.asarray(data, dtype=DATATYPES[datatype])
    if array.size != int(np.prod(shape)):
        raise ValueError(f"{array.size} values do not fill shape {list(shape)}")
    return array.reshape(shape)


def v2_json_request(inputs: Mapping[str, np.ndarray]) -> bytes:
    """The body both peers get: ``{"inputs": [v2 tensors]}``, plain KServe v2 JSON (no binary extension)."""
    return json.dumps({"inputs": [v2_tensor(k, v) for k, v in inputs.items()]}).encode()


def decode_v2_tensors(tensors: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """Arrays by name of a list of v2 JSON tensors (a request's ``inputs`` or a response's ``outputs``)."""
    return {t["name"]: array_from_v2(t["data"], t["datatype"], t["shape"]) for t in tensors}


def decode_v2_response(body: bytes) -> dict[str, np.ndarray]:
    """Output arrays by name of a v2 JSON response (MLServer's, and LitServe's as :class:`LitServeAPI` encodes)."""
    doc = json.loads(body)
    if "outputs" not in doc:
        raise ValueError(f"a response without 'outputs': {body[:300]!r}")
    return decode_v2_tensors(doc["outputs"])


def concat_samples(requests: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One batch of single-sample requests: each input concatenated along axis 0, in request order."""
    return {k: np.concatenate([r[k] for r in requests]) for k in requests[0]}


def split_samples(outputs: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """A batch's outputs back into one single-sample answer per request (row i to request i)."""
    n = len(next(iter(outputs.values())))
    return [{k: v[i:i + 1] for k, v in outputs.items()} for i in range(n)]


def decode_litserve_request(request: Mapping[str, Any], datatypes: Mapping[str, str]) -> dict[str, np.ndarray]:
    """One request of :func:`v2_json_request` as LitServe hands it over: one sample of each input the model takes."""
    inputs = decode_v2_tensors(request["inputs"])
    if sorted(inputs) != sorted(datatypes):
        raise ValueError(f"inputs {sorted(inputs)}: the model takes {sorted(datatypes)}")
    for name, array in inputs.items():
        if datatype_of(array.dtype) != datatypes[name] or len(array) != 1:
            raise ValueError(f"input {name!r}: send one sample of {datatypes[name]}, got {array.dtype} "
                             f"shape {list(array.shape)}")
    return inputs


def split_by_sizes(outputs: Mapping[str, np.ndarray], sizes: Sequence[int]) -> list[dict[str, np.ndarray]]:
    """A batch's outputs back into one answer per request of ``sizes[i]`` rows each, in order (Triton's Python
    backend hands a model the batcher's requests as they came, each possibly of several samples)."""
    n = len(next(iter(outputs.values())))
    if sum(sizes) != n:
        raise ValueError(f"requests of {list(sizes)} samples, but the batch answered {n}")
    bounds = np.cumsum([0, *sizes])
    return [{k: np.ascontiguousarray(v[lo:hi]) for k, v in outputs.items()} for lo, hi in zip(bounds, bounds[1:])]


def restore_output_shapes(outputs: Mapping[str, np.ndarray], shapes: Mapping[str, Sequence[int]]
                          ) -> dict[str, np.ndarray]:
    """Triton's answer in our signature's shapes (batch axis -1): a per-sample scalar comes back ``(n, 1)`` from
    Triton (see :func:`.peer_settings.triton_tensor`) and goes back to ``(n,)``; nothing else is reshaped."""
    out = {}
    for name, array in outputs.items():
        shape = shapes.get(name)
        if shape is not None and len(shape) == 1 and array.ndim == 2 and array.shape[1] == 1:
            array = array.reshape(-1)
        out[name] = array
    return out
