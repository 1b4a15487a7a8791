"""Open Inference Protocol (KServe v2) tensors: JSON and the binary extension.

A tensor is ``{"name", "shape", "datatype", "data"}`` with ``data`` flattened in
row-major order (nested lists are accepted too). With the binary tensor
extension a tensor's bytes follow the JSON header instead: the
``Inference-Header-Content-Length`` HTTP header gives the JSON header's length,
each binary input carries ``parameters.binary_data_size`` and the bytes come in
input order, little-endian, row-major. Outputs are returned as binary when the
request says ``parameters.binary_data_output`` or the output's own
``parameters.binary_data``.

Spec: https://kserve.github.io/website/latest/modelserving/data_plane/v2_protocol/
and Triton's binary_tensor_data extension.

Both directions live here: the server's parse/encode and the client's
encode/parse, so they cannot drift apart.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import orjson

from ..contract import TensorSpec

HEADER_LENGTH = "Inference-Header-Content-Length"
JSON_TYPE = "application/json"
BINARY_TYPE = "application/octet-stream"

# KServe v2 datatype -> little-endian numpy dtype. BYTES (strings) is refused: no converge model takes text.
DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype("?"),
    "INT8": np.dtype("<i1"), "INT16": np.dtype("<i2"), "INT32": np.dtype("<i4"), "INT64": np.dtype("<i8"),
    "UINT8": np.dtype("<u1"), "UINT16": np.dtype("<u2"), "UINT32": np.dtype("<u4"), "UINT64": np.dtype("<u8"),
    "FP16": np.dtype("<f2"), "FP32": np.dtype("<f4"), "FP64": np.dtype("<f8"),
}
UNSUPPORTED = {"BYTES": "BYTES (string) tensors are not supported: converge models take numbers",
               "BF16": "BF16 tensors are not supported: send FP32"}


class ValidationError(ValueError):
    """A request that does not match the protocol or the model's signature (HTTP 400)."""


DATATYPE_OF = {dt: name for name, dt in DATATYPES.items()}


def datatype_of(dtype: np.dtype) -> str:
    """The KServe datatype of a numpy dtype (any byte order)."""
    if dtype in DATATYPE_OF:  # the common case, a dict lookup: this runs for every tensor of every request
        return DATATYPE_OF[dtype]
    dtype = np.dtype(dtype).newbyteorder("<") if np.dtype(dtype).byteorder == ">" else np.dtype(dtype)
    for name, dt in DATATYPES.items():
        if dt == dtype:
            return name
    raise ValidationError(f"numpy dtype {dtype} has no Open Inference Protocol datatype; use one of "
                          + ", ".join(str(d) for d in DATATYPES.values()))


@dataclass
class InferRequest:
    """A parsed request: validated arrays by input name and how each output is wanted."""

    inputs: dict[str, np.ndarray]
    outputs: dict[str, bool]  # output name -> send as binary
    id: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return len(next(iter(self.inputs.values())))


# -- server side ---------------------------------------------------------------------------------------------------
def split_body(body: bytes, header_length: str | int | None) -> tuple[dict, bytes]:
    """(JSON header, binary part) of a request or response body."""
    if header_length is None or header_length == "":
        head, rest = body, b""
    else:
        try:
            n = int(header_length)
        except ValueError:
            raise ValidationError(f"{HEADER_LENGTH}: {header_length!r} is not an integer") from None
        if not 0 <= n <= len(body):
            raise ValidationError(f"{HEADER_LENGTH}={n} but the body holds {len(body)} bytes")
        head, rest = body[:n], body[n:]
    try:
        doc = orjson.loads(head)  # 13x the standard library on 2,048 floats: most of a JSON request's time
    except orjson.JSONDecodeError:
        doc = loads_leniently(head)
    if not isinstance(doc, dict):
        raise ValidationError("request body must be a JSON object with an 'inputs' list")
    return doc, rest


def loads_leniently(head: bytes) -> Any:
    """The standard library's reading of what orjson refused: it also takes NaN/Infinity (refused later, by
    name) and integers past 64 bits (refused by range); else a :class:`ValidationError` saying why."""
    try:
        return json.loads(head)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValidationError(f"request body is not valid JSON ({err}); binary data needs the "
                              f"{HEADER_LENGTH} header") from None


def _shape_of(name: str, tensor: dict) -> tuple[int, ...]:
    shape = tensor.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise ValidationError(f"input {name!r}: 'shape' must be a list of non-negative integers, got {shape!r}")
    return tuple(shape)


def _json_array(name: str, data: Any, datatype: str, shape: tuple[int, ...]) -> np.ndarray:
    dtype = DATATYPES[datatype]
    try:
        raw = np.asarray(data)
    except ValueError:
        raise ValidationError(f"input {name!r}: 'data' is a ragged nested list; send it flattened") from None
    raw = raw.reshape(-1)
    expected = math.prod(shape)
    if raw.size != expected:
        raise ValidationError(f"input {name!r}: shape {list(shape)} needs {expected} values, got {raw.size}")
    kind = raw.dtype.kind
    if dtype.kind in "iu" and kind in "fO":  # integers beyond int64 come out as float or object: keep them exact
        exact = np.asarray(data, dtype=object).reshape(-1)
        if all(type(v) is int for v in exact):
            raw, kind = exact, "i"
    kinds = {"b": "b", "i": "biu", "u": "biu", "f": "biuf"}[dtype.kind]
    if raw.size and kind not in kinds:
        want = {"b": "true/false", "i": "integers", "u": "integers", "f": "numbers"}[dtype.kind]
        raise ValidationError(f"input {name!r}: datatype {datatype} needs {want} in 'data', got values like "
                              f"{raw[0].item() if hasattr(raw[0], 'item') else raw[0]!r}")
    if dtype.kind in "iu" and raw.size:
        info = np.iinfo(dtype)
        if int(raw.min()) < info.min or int(raw.max()) > info.max:
            raise ValidationError(f"input {name!r}: values outside the {datatype} range [{info.min}, {info.max}]")
    with np.errstate(over="ignore"):
        return raw.astype(dtype).reshape(shape)


def _binary_array(name: str, size: Any, datatype: str, shape: tuple[int, ...], blob: bytes, offset: int) -> np.ndarray:
    dtype = DATATYPES[datatype]
    expected = math.prod(shape) * dtype.itemsize
    if not isinstance(size, int) or isinstance(size, bool) or size != expected:
        raise ValidationError(f"input {name!r}: binary_data_size={size!r} but shape {list(shape)} of {datatype} "
                              f"needs {expected} bytes")
    if offset + size > len(blob):
        raise ValidationError(f"input {name!r}: binary data ends after {len(blob) - offset} of its {size} bytes")
    return np.frombuffer(blob, dtype=dtype, count=math.prod(shape), offset=offset).reshape(shape)


def decode_tensors(tensors: Any, blob: bytes, what: str = "inputs") -> dict[str, np.ndarray]:
    """Arrays by name from a list of JSON tensors and the binary part after the header."""
    if not isinstance(tensors, list) or not tensors:
        raise ValidationError(f"'{what}' must be a non-empty list of tensors")
    arrays: dict[str, np.ndarray] = {}
    offset = 0
    for i, tensor in enumerate(tensors):
        if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
            raise ValidationError(f"{what}[{i}] must be an object with a string 'name'")
        name, datatype = tensor["name"], tensor.get("datatype")
        if name in arrays:
            raise ValidationError(f"input {name!r} appears twice")
        if datatype in UNSUPPORTED:
            raise ValidationError(f"input {name!r}: {UNSUPPORTED[datatype]}")
        if datatype not in DATATYPES:
            raise ValidationError(f"input {name!r}: unknown datatype {datatype!r}; use one of {', '.join(DATATYPES)}")
        shape = _shape_of(name, tensor)
        params = tensor.get("parameters") or {}
        if not isinstance(params, dict):
            raise ValidationError(f"input {name!r}: 'parameters' must be an object")
        if "binary_data_size" in params:
            if "data" in tensor:
                raise ValidationError(f"input {name!r} has both 'data' and binary_data_size; send one")
            arrays[name] = _binary_array(name, params["binary_data_size"], datatype, shape, blob, offset)
            offset += params["binary_data_size"]
        elif "data" in tensor:
            arrays[name] = _json_array(name, tensor["data"], datatype, shape)
        else:
            raise ValidationError(f"input {name!r} has neither 'data' nor parameters.binary_data_size")
    if offset != len(blob):
        raise ValidationError(f"{len(blob) - offset} bytes of binary data are not claimed by any binary_data_size")
    return arrays


def check_inputs(arrays: Mapping[str, np.ndarray], specs: Sequence[TensorSpec]) -> None:
    """Names, datatypes, shapes, a common batch size >= 1 and finite floats, per the model's signature."""
    want = {s.name: s for s in specs}
    for name in arrays:
        if name not in want:
            raise ValidationError(f"unknown input {name!r}; the model takes {', '.join(map(repr, want))}")
    batch = None
    for spec in specs:
        if spec.name not in arrays:
            raise ValidationError(f"missing input {spec.name!r} ({spec.datatype}, shape {list(spec.shape)})")
        arr = arrays[spec.name]
        if datatype_of(arr.dtype) != spec.datatype:
            raise ValidationError(f"input {spec.name!r}: datatype {datatype_of(arr.dtype)}, expected {spec.datatype}")
        ok = len(arr.shape) == len(spec.shape) and all(w in (-1, d) for w, d in zip(spec.shape, arr.shape))
        if not ok:
            raise ValidationError(f"input {spec.name!r}: shape {list(arr.shape)}, expected {list(spec.shape)} "
                                  "(-1: any size)")
        if arr.shape[0] < 1:
            raise ValidationError(f"input {spec.name!r}: the batch axis is empty; send at least one sample")
        if batch is not None and arr.shape[0] != batch:
            raise ValidationError(f"input {spec.name!r}: batch size {arr.shape[0]}, but other inputs have {batch}")
        batch = arr.shape[0]
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise ValidationError(f"input {spec.name!r}: {int(np.size(arr) - np.isfinite(arr).sum())} values are "
                                  "NaN or infinite; send finite numbers")


def parse_infer_request(body: bytes, header_length: str | int | None, inputs: Sequence[TensorSpec],
                        outputs: Sequence[TensorSpec]) -> InferRequest:
    """Parse and validate a POST .../infer body against the model's signature."""
    doc, blob = split_body(body, header_length)
    arrays = decode_tensors(doc.get("inputs"), blob)
    check_inputs(arrays, inputs)
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise ValidationError("request 'parameters' must be an object")
    default_binary = bool(params.get("binary_data_output", False))
    names = [s.name for s in outputs]
    requested = doc.get("outputs")
    if requested is None:
        wanted = {n: default_binary for n in names}
    else:
        if not isinstance(requested, list) or not all(isinstance(o, dict) for o in requested):
            raise ValidationError("'outputs' must be a list of objects with a 'name'")
        wanted = {}
        for o in requested:
            if o.get("name") not in names:
                raise ValidationError(f"unknown output {o.get('name')!r}; the model gives {', '.join(map(repr, names))}")
            wanted[o["name"]] = bool((o.get("parameters") or {}).get("binary_data", default_binary))
    request_id = doc.get("id")
    return InferRequest(arrays, wanted, None if request_id is None else str(request_id), params)


@dataclass(frozen=True)
class BinaryLayout:
    """What a binary request's JSON header said, once checked against the model's signature: each input's
    name, dtype, shape and place in the binary part, and the request's outputs, id and parameters."""

    arrays: tuple[tuple[str, np.dtype, tuple[int, ...], int, int], ...]  # name, dtype, shape, offset, count
    blob_size: int
    finite: tuple[str, ...]  # the float inputs, whose values are checked on every request
    outputs: dict[str, bool]
    id: str | None
    parameters: dict[str, Any]


class RequestParser:
    """:func:`parse_infer_request` for one model's signature, remembering the JSON headers of binary requests.

    A client of the binary extension sends the same JSON header with every request of one shape (only the
    bytes after it change). A header seen before and checked then is not parsed or checked again: its inputs
    are read from the binary part at the places it gave, and only the values are checked (finite floats).
    A request of 2,048 gw floats took 35 us to parse and check, most of it the header. The cache holds up to
    ``size`` headers and starts again when full, so headers that never repeat (a distinct ``id`` in each)
    cost only the parse they would have cost anyway. JSON bodies (data inside the JSON) are parsed each time.
    """

    def __init__(self, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec], size: int = 256) -> None:
        self.inputs, self.outputs, self.size = tuple(inputs), tuple(outputs), size
        self.layouts: dict[bytes, BinaryLayout] = {}

    def __call__(self, body: bytes, header_length: str | int | None) -> InferRequest:
        binary = header_length is not None and header_length != ""
        if binary:
            n = int(header_length) if isinstance(header_length, int) or header_length.isdigit() else -1
            layout = self.layouts.get(body[:n]) if 0 <= n <= len(body) else None
            if layout is not None and len(body) - n == layout.blob_size:
                return self._read(layout, body, n)
        request = parse_infer_request(body, header_length, self.inputs, self.outputs)
        if binary:  # parsed, so the length is a valid one
            head = body[:int(header_length)]
            layout = self._layout(request, head)
            if layout is not None:
                if len(self.layouts) >= self.size:
                    self.layouts.clear()
                self.layouts[head] = layout
        return request

    def _read(self, layout: BinaryLayout, body: bytes, start: int) -> InferRequest:
        arrays = {name: np.frombuffer(body, dtype, count, start + offset).reshape(shape)
                  for name, dtype, shape, offset, count in layout.arrays}
        for name in layout.finite:
            if not np.isfinite(arrays[name]).all():  # the full parse says which input and how many values
                return parse_infer_request(body, start, self.inputs, self.outputs)
        return InferRequest(arrays, dict(layout.outputs), layout.id, layout.parameters)

    @staticmethod
    def _layout(request: InferRequest, head: bytes) -> BinaryLayout | None:
        """The layout of a parsed binary request (its JSON header ``head``) whose every input came in the binary
        part, else None."""
        try:
            tensors = orjson.loads(head)["inputs"]
        except (orjson.JSONDecodeError, KeyError, TypeError):  # parsed leniently (NaN in the header): not kept
            return None
        arrays, offset = [], 0
        for tensor in tensors:
            size = (tensor.get("parameters") or {}).get("binary_data_size")
            if size is None:  # data in the JSON: the header changes with the values
                return None
            arr = request.inputs[tensor["name"]]
            arrays.append((tensor["name"], arr.dtype, arr.shape, offset, arr.size))
            offset += size
        finite = tuple(name for name, arr in request.inputs.items() if arr.dtype.kind == "f")
        return BinaryLayout(tuple(arrays), offset, finite, dict(request.outputs), request.id, request.parameters)


def encode_tensors(arrays: Mapping[str, np.ndarray], binary: Mapping[str, bool]) -> tuple[list[dict], list[bytes]]:
    """JSON tensors and the binary chunks (in order) for ``arrays``."""
    tensors, chunks = [], []
    for name, arr in arrays.items():
        arr = np.asarray(arr)
        datatype = datatype_of(arr.dtype)
        tensor: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(arr.shape)}
        if binary.get(name, False):
            raw = np.ascontiguousarray(arr, dtype=DATATYPES[datatype]).tobytes()
            tensor["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            if arr.dtype.kind == "f" and not np.isfinite(arr).all():
                raise ValueError(f"tensor {name!r} holds NaN or infinity, which JSON cannot carry; "
                                 "send it as binary data")
            tensor["data"] = arr.reshape(-1).tolist()
        tensors.append(tensor)
    return tensors, chunks


def encode_message(doc: dict, chunks: Sequence[bytes]) -> tuple[bytes, dict[str, str]]:
    """(body, headers) of a request or response: JSON alone, or JSON header plus binary chunks."""
    head = orjson.dumps(doc)  # would write NaN and inf as null: encode_tensors refuses them first
    if not chunks:
        return head, {"Content-Type": JSON_TYPE}
    return head + b"".join(chunks), {"Content-Type": BINARY_TYPE, HEADER_LENGTH: str(len(head))}


def encode_infer_response(model: str, version: str, request: InferRequest,
                          results: Mapping[str, np.ndarray]) -> tuple[bytes, dict[str, str]]:
    """The response to ``request``: the requested outputs, binary where asked."""
    chosen = {name: results[name] for name in request.outputs}
    tensors, chunks = encode_tensors(chosen, request.outputs)
    doc: dict[str, Any] = {"model_name": model, "model_version": version, "outputs": tensors}
    if request.id is not None:
        doc["id"] = request.id
    return encode_message(doc, chunks)


class ResponseEncoder:
    """:func:`encode_infer_response` for one model, remembering the JSON header of answers sent all in binary.

    Answers to requests of one shape share their JSON header (names, datatypes, shapes, byte counts): it is
    written once and kept, keyed by the request's id and each output's name, dtype and shape, and later
    answers are that header and their bytes. Returns the body and its HTTP headers as (lower-case name,
    value) bytes. At most ``size`` headers are kept (then it starts again, as :class:`RequestParser` does);
    an answer with any output as JSON is encoded in full each time.
    """

    def __init__(self, model: str, version: str, size: int = 256) -> None:
        self.model, self.version, self.size = model, version, size
        self.heads: dict[tuple, tuple[bytes, list[tuple[bytes, bytes]], tuple[np.dtype, ...]]] = {}

    def __call__(self, request: InferRequest, results: Mapping[str, np.ndarray]
                 ) -> tuple[bytes, list[tuple[bytes, bytes]]]:
        if not request.outputs or not all(request.outputs.values()):  # none asked for: a JSON header alone
            return self._full(request, results)
        arrays = [np.asarray(results[name]) for name in request.outputs]
        key = (request.id, tuple((name, a.dtype, a.shape) for name, a in zip(request.outputs, arrays)))
        known = self.heads.get(key)
        if known is None:
            content, headers = self._full(request, results)
            if len(self.heads) >= self.size:
                self.heads.clear()
            head_length = int(dict(headers)[HEADER_LENGTH.lower().encode("latin-1")])
            self.heads[key] = (content[:head_length], headers, tuple(DATATYPES[datatype_of(a.dtype)] for a in arrays))
            return content, headers
        head, headers, dtypes = known
        return b"".join([head, *(np.ascontiguousarray(a, dtype=d).tobytes() for a, d in zip(arrays, dtypes))]), headers

    def _full(self, request: InferRequest, results: Mapping[str, np.ndarray]) -> tuple[bytes, list[tuple[bytes, bytes]]]:
        content, headers = encode_infer_response(self.model, self.version, request, results)
        return content, [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]


# -- client side ---------------------------------------------------------------------------------------------------
def encode_infer_request(inputs: Mapping[str, np.ndarray], binary: bool = True,
                         outputs: Sequence[str] | None = None, request_id: str | None = None) -> tuple[bytes, dict]:
    """A request body and headers; ``binary`` sends inputs as bytes and asks for binary outputs."""
    tensors, chunks = encode_tensors(inputs, {name: binary for name in inputs})
    doc: dict[str, Any] = {"inputs": tensors, "parameters": {"binary_data_output": binary}}
    if outputs is not None:
        doc["outputs"] = [{"name": n, "parameters": {"binary_data": binary}} for n in outputs]
    if request_id is not None:
        doc["id"] = request_id
    return encode_message(doc, chunks)


def decode_infer_response(body: bytes, header_length: str | int | None) -> dict[str, np.ndarray]:
    """Output arrays by name from a response body (JSON or binary); copies so they are writable."""
    try:
        doc, blob = split_body(body, header_length)
        return {k: np.array(v) for k, v in decode_tensors(doc.get("outputs"), blob, "outputs").items()}
    except ValidationError as err:
        raise ValidationError(f"malformed response from the server: {err}") from None
