"""The server's routes read a request body as FastAPI would, with its ``vlens`` object apart."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from vlens.serve.body import VlensRequest, vlens_field


def request_of(body: bytes) -> VlensRequest:
    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [],
             "query_string": b""}
    return VlensRequest(scope, receive)


def test_the_vlens_object_is_taken_out_of_the_body():
    fields = {"steering": [{"name": "blocks.0.hook_resid_post", "add": [0.5, -1.25]}]}
    request = request_of(json.dumps({"model": "m", "prompt": [1, 2], "vlens": fields}).encode())
    assert asyncio.run(request.json()) == {"model": "m", "prompt": [1, 2]}
    assert vlens_field(request) == fields


def test_a_body_msgspec_refuses_is_read_as_the_standard_library_reads_it():
    request = request_of(b'{"model": "m", "temperature": NaN, "vlens": {"capture": ["x"]}}')
    body = asyncio.run(request.json())
    assert math.isnan(body["temperature"]) and vlens_field(request) == {"capture": ["x"]}
    plain = request_of(b'[1, 2]')  # not an object: vLLM's validation refuses it
    assert asyncio.run(plain.json()) == [1, 2] and vlens_field(plain) is None
    with pytest.raises(json.JSONDecodeError):  # FastAPI answers it as invalid JSON
        asyncio.run(request_of(b'{"model": ').json())
