"""KServe v2 tensors: JSON and binary round trips for every datatype, and every validation message."""
import json

import numpy as np
import pytest

from converge.contract import TensorSpec
from converge.serve.protocol import (DATATYPES, HEADER_LENGTH, InferRequest, ValidationError, datatype_of,
                                     decode_infer_response, encode_infer_request, encode_infer_response,
                                     parse_infer_request)

SPECS = [TensorSpec("x", "FP32", (-1, 2)), TensorSpec("k", "INT64", (-1,))]
OUTS = [TensorSpec("y", "FP32", (-1,)), TensorSpec("z", "FP64", (-1, 2))]


def example(dtype: np.dtype) -> np.ndarray:
    if dtype.kind == "b":
        return np.array([[True, False, True], [False, False, True]])
    if dtype.kind == "f":
        return np.array([[0.5, -1.25, 3.0], [1e3, 0.0, -7.5]], dtype=dtype)
    info = np.iinfo(dtype)
    return np.array([[info.min, 0, info.max], [1, 2, 3]], dtype=dtype)


@pytest.mark.parametrize("datatype", list(DATATYPES))
@pytest.mark.parametrize("binary", [False, True])
def test_every_datatype_round_trips(datatype, binary):
    arr = example(DATATYPES[datatype])
    body, headers = encode_infer_request({"t": arr}, binary=binary)
    assert (HEADER_LENGTH in headers) == binary
    req = parse_infer_request(body, headers.get(HEADER_LENGTH), [TensorSpec("t", datatype, (-1, 3))], OUTS)
    assert req.inputs["t"].dtype == DATATYPES[datatype]
    np.testing.assert_array_equal(req.inputs["t"], arr)
    assert req.outputs == {"y": binary, "z": binary}


def test_json_data_is_row_major_and_may_be_nested():
    flat = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 2], "data": [1, 2, 3, 4]},
                       {"name": "k", "datatype": "INT64", "shape": [2], "data": [5, 6]}]}
    nested = json.loads(json.dumps(flat))
    nested["inputs"][0]["data"] = [[1, 2], [3, 4]]
    for doc in (flat, nested):
        req = parse_infer_request(json.dumps(doc).encode(), None, SPECS, OUTS)
        np.testing.assert_array_equal(req.inputs["x"], [[1, 2], [3, 4]])
        assert req.batch_size == 2


def test_response_mixes_binary_and_json_outputs_as_requested():
    doc = {"id": "r1", "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]},
                                  {"name": "k", "datatype": "INT64", "shape": [1], "data": [3]}],
           "outputs": [{"name": "z", "parameters": {"binary_data": True}}, {"name": "y"}]}
    req = parse_infer_request(json.dumps(doc).encode(), None, SPECS, OUTS)
    results = {"y": np.array([0.5], np.float32), "z": np.array([[1.0, 2.0]])}
    body, headers = encode_infer_response("m", "1", req, results)
    header = json.loads(body[:int(headers[HEADER_LENGTH])])
    assert header["id"] == "r1" and [o["name"] for o in header["outputs"]] == ["z", "y"]
    assert header["outputs"][0]["parameters"] == {"binary_data_size": 16} and header["outputs"][1]["data"] == [0.5]
    out = decode_infer_response(body, headers[HEADER_LENGTH])
    np.testing.assert_array_equal(out["z"], results["z"])
    np.testing.assert_array_equal(out["y"], results["y"])
    json_only = parse_infer_request(json.dumps({**doc, "outputs": [{"name": "y"}]}).encode(), None, SPECS, OUTS)
    body, headers = encode_infer_response("m", "1", json_only, results)
    assert HEADER_LENGTH not in headers and list(decode_infer_response(body, None)) == ["y"]


def good() -> dict:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]},
                       {"name": "k", "datatype": "INT64", "shape": [1], "data": [3]}]}


def with_input(i: int, **changes) -> dict:
    doc = good()
    doc["inputs"][i].update(changes)
    for key, value in changes.items():
        if value is None:
            del doc["inputs"][i][key]
    return doc


@pytest.mark.parametrize("doc, message", [
    ([1, 2], "must be a JSON object"),
    ({"inputs": []}, "'inputs' must be a non-empty list"),
    ({"inputs": [{"shape": [1]}]}, r"inputs\[0\] must be an object with a string 'name'"),
    (with_input(0, datatype="FLOAT"), "input 'x': unknown datatype 'FLOAT'"),
    (with_input(0, datatype="BYTES"), "input 'x': BYTES .* not supported"),
    (with_input(0, shape=[1, -2]), "input 'x': 'shape' must be a list of non-negative integers"),
    (with_input(0, data=[1.0]), r"input 'x': shape \[1, 2\] needs 2 values, got 1"),
    (with_input(0, data=[[1.0], [2.0, 3.0]]), "input 'x': 'data' is a ragged nested list"),
    (with_input(0, data=["a", "b"]), "input 'x': datatype FP32 needs numbers"),
    (with_input(1, data=[1.5]), "input 'k': datatype INT64 needs integers"),
    (with_input(1, datatype="INT8", data=[300]), r"input 'k': values outside the INT8 range \[-128, 127\]"),
    (with_input(0, data=None), "input 'x' has neither 'data' nor parameters.binary_data_size"),
    (with_input(0, parameters={"binary_data_size": 8}), "input 'x' has both 'data' and binary_data_size"),
    (with_input(0, parameters=[1]), "input 'x': 'parameters' must be an object"),
    ({"inputs": good()["inputs"] * 2}, "input 'x' appears twice"),
    ({"inputs": good()["inputs"] + [{"name": "w", "datatype": "FP32", "shape": [1], "data": [1]}]},
     "unknown input 'w'; the model takes 'x', 'k'"),
    ({"inputs": good()["inputs"][:1]}, r"missing input 'k' \(INT64, shape \[-1\]\)"),
    (with_input(0, datatype="FP64"), "input 'x': datatype FP64, expected FP32"),
    (with_input(0, shape=[2, 1]), r"input 'x': shape \[2, 1\], expected \[-1, 2\]"),
    (with_input(0, shape=[1, 1, 2]), r"input 'x': shape \[1, 1, 2\], expected \[-1, 2\]"),
    (with_input(1, shape=[2], data=[1, 2]), "input 'k': batch size 2, but other inputs have 1"),
    (with_input(0, shape=[0, 2], data=[]), "input 'x': the batch axis is empty"),
    (with_input(0, data=[1.0, float("nan")]), "input 'x': 1 values are NaN or infinite"),
    ({**good(), "parameters": [1]}, "request 'parameters' must be an object"),
    ({**good(), "outputs": [{"name": "q"}]}, "unknown output 'q'; the model gives 'y', 'z'"),
    ({**good(), "outputs": {"name": "y"}}, "'outputs' must be a list of objects"),
])
def test_invalid_json_requests_name_the_problem(doc, message):
    with pytest.raises(ValidationError, match=message):
        parse_infer_request(json.dumps(doc).encode(), None, SPECS, OUTS)


def binary_request(**override) -> tuple[bytes, str]:
    x = np.array([[1.0, np.inf]], dtype=np.float32) if override.get("inf") else np.ones((1, 2), np.float32)
    body, headers = encode_infer_request({"x": x, "k": np.array([1])}, binary=True)
    return body, headers[HEADER_LENGTH]


def test_invalid_binary_requests_name_the_problem():
    body, length = binary_request()
    head, blob = body[:int(length)], body[int(length):]
    cases = [
        (body, "abc", "is not an integer"),
        (body, str(len(body) + 1), f"{HEADER_LENGTH}={len(body) + 1} but the body holds {len(body)} bytes"),
        (body, None, "not valid JSON"),
        (head + blob[:-3], length, "input 'k': binary data ends after 5 of its 8 bytes"),
        (head + blob + b"xx", length, "2 bytes of binary data are not claimed"),
        (*binary_request(inf=True), "input 'x': 1 values are NaN or infinite"),
    ]
    doc = json.loads(head)
    doc["inputs"][0]["parameters"]["binary_data_size"] = 7
    bad_head = json.dumps(doc).encode()
    cases.append((bad_head + blob, str(len(bad_head)), r"input 'x': binary_data_size=7 but shape \[1, 2\] of FP32 "
                                                        "needs 8 bytes"))
    for content, header, message in cases:
        with pytest.raises(ValidationError, match=message):
            parse_infer_request(content, header, SPECS, OUTS)


def test_datatype_of_refuses_what_the_protocol_cannot_carry():
    assert datatype_of(np.dtype(">f4")) == "FP32"
    with pytest.raises(ValidationError, match="complex128 has no Open Inference Protocol datatype"):
        datatype_of(np.dtype(np.complex128))


def test_non_finite_outputs_go_as_binary_never_as_json_null():
    arrays = {"y": np.array([1.0, np.nan], np.float32)}
    with pytest.raises(ValueError, match="'y' holds NaN or infinity.*send it as binary"):
        encode_infer_request(arrays, binary=False)
    body, headers = encode_infer_request(arrays, binary=True)
    head = json.loads(body[:int(headers[HEADER_LENGTH])])
    assert head["inputs"][0]["parameters"] == {"binary_data_size": 8}


def test_json_the_fast_parser_refuses_still_gets_its_precise_error():
    doc = '{"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, NaN]}]}'
    with pytest.raises(ValidationError, match="input 'x': 1 values are NaN or infinite"):
        parse_infer_request(doc.encode(), None, [TensorSpec("x", "FP32", (-1, 4))], [])
    with pytest.raises(ValidationError, match="not valid JSON"):
        parse_infer_request(b'{"inputs": [', None, [TensorSpec("x", "FP32", (-1, 4))], [])


def test_request_parser_reads_a_header_it_knows_as_the_full_parse_does():
    from converge.serve.protocol import RequestParser

    parser, rng = RequestParser(SPECS, OUTS), np.random.default_rng(0)
    for _ in range(5):  # one header, new values each time: parsed once, then read from the binary part
        x, k = rng.normal(size=(3, 2)).astype(np.float32), rng.integers(-9, 9, size=3)
        body, headers = encode_infer_request({"x": x, "k": k}, binary=True, outputs=["y"])
        got, want = parser(body, headers[HEADER_LENGTH]), parse_infer_request(body, headers[HEADER_LENGTH], SPECS, OUTS)
        for name in ("x", "k"):
            assert got.inputs[name].dtype == want.inputs[name].dtype
            np.testing.assert_array_equal(got.inputs[name], want.inputs[name])
        assert (got.outputs, got.id, got.parameters) == (want.outputs, want.id, want.parameters)
    assert len(parser.layouts) == 1
    got.outputs["z"] = True  # a request's own copy: the next one is not changed
    assert parser(body, headers[HEADER_LENGTH]).outputs == {"y": True}


def test_request_parser_refuses_after_a_known_header_what_the_full_parse_refuses():
    from converge.serve.protocol import RequestParser

    parser = RequestParser(SPECS, OUTS)
    body, length = binary_request()
    parser(body, length)  # the header is known from here on
    head, blob = body[:int(length)], body[int(length):]
    cases = [(head + blob[:-3], length, "input 'k': binary data ends after 5 of its 8 bytes"),
             (head + blob + b"xx", length, "2 bytes of binary data are not claimed"),
             (*binary_request(inf=True), "input 'x': 1 values are NaN or infinite"),
             (body, "abc", "is not an integer"),
             (body, str(len(body) + 1), f"{HEADER_LENGTH}={len(body) + 1} but the body holds")]
    for content, header, message in cases:
        with pytest.raises(ValidationError, match=message):
            parser(content, header)
    assert len(parser.layouts) == 1


def test_request_parser_keeps_only_binary_headers_and_at_most_its_size():
    from converge.serve.protocol import RequestParser

    parser = RequestParser(SPECS, OUTS, size=3)
    x, k = np.ones((1, 2), np.float32), np.array([1])
    body, headers = encode_infer_request({"x": x, "k": k}, binary=False)
    np.testing.assert_array_equal(parser(body, headers.get(HEADER_LENGTH)).inputs["x"], x)
    assert not parser.layouts  # JSON data: the values are in the header
    for i in range(7):  # a distinct id in every header: never seen twice
        body, headers = encode_infer_request({"x": x, "k": k}, binary=True, request_id=str(i))
        assert parser(body, headers[HEADER_LENGTH]).id == str(i)
        assert len(parser.layouts) <= 3


def test_response_encoder_answers_byte_for_byte_as_the_full_encoding():
    from converge.serve.protocol import ResponseEncoder

    encoder, rng = ResponseEncoder("m", "1", size=4), np.random.default_rng(1)
    binary = InferRequest({}, {"y": True, "z": True})
    mixed = InferRequest({}, {"y": True, "z": False}, id="7")
    for n in (2, 2, 3, 2):  # a new shape gets a header of its own; float64 y is sent as the FP64 it is
        results = {"y": rng.normal(size=n), "z": rng.normal(size=(n, 2)).astype(np.float32)}
        for request in (binary, mixed):
            content, headers = encoder(request, results)
            want, want_headers = encode_infer_response("m", "1", request, results)
            assert content == want
            assert headers == [(k.lower().encode(), v.encode()) for k, v in want_headers.items()]
            got = decode_infer_response(content, dict(headers).get(b"inference-header-content-length", b"").decode()
                                        or None)
            np.testing.assert_array_equal(got["z"], results["z"])
    assert len(encoder.heads) == 2  # all-binary answers of 2 and of 3 samples; the mixed ones each time
    none = InferRequest({}, {})  # "outputs": [] asks for none: the answer is its JSON header alone
    assert encoder(none, results) == (encode_infer_response("m", "1", none, results)[0],
                                      [(b"content-type", b"application/json")])


def test_response_encoder_keeps_at_most_its_size():
    from converge.serve.protocol import ResponseEncoder

    encoder = ResponseEncoder("m", "1", size=2)
    for i in range(5):  # a distinct id each time
        content, _ = encoder(InferRequest({}, {"y": True}, id=str(i)), {"y": np.zeros(1)})
        assert f'"id":"{i}"'.encode() in content
        assert len(encoder.heads) <= 2
