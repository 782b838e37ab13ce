"""vlens's HTTP surface on vLLM's OpenAI server, as a vLLM endpoint plugin (the ``vlens``
entry point of ``vllm.endpoint_plugins``, turned on by ``vlens serve`` only).

- ``POST /v1/completions`` and ``/v1/chat/completions``: vLLM's own handlers, after the request's
  ``vlens`` object is read and planned (an HTTP 400 names what is wrong) and the plan admitted
  into :class:`~vlens.serve.engine_client.VlensEngineClient` under a ticket that ``vllm_xargs``
  carries to it; a response to a request that captured names gains
  ``"vlens": {"activations": ID, "names": {name: shape}}``.
- ``GET /v1/activations/{id}``: those values as a safetensors file, deleted once fetched.
- ``GET /v1/vlens/status``: what the server holds (the held captures' entries and bytes,
  admitted plans, and the requests each worker follows).

Being routes of vLLM's app, they sit behind its middleware, ``--api-key`` included.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest

from vlens.runtime.compiled.inline import INLINE_KEY
from vlens.runtime.transfer.messages import TAG_KEY
from vlens.serve.body import VlensRoute, vlens_field
from vlens.serve.engine_client import FIELDS_KEY, STOPPED, VlensEngineClient, sample_key
from vlens.serve.fields import BadVlensField, read_fields

Endpoint = Callable[..., Awaitable[Any]]


@dataclass
class Serving:
    """What the routes reach: set by ``vlens serve`` before vLLM builds its app."""

    client: VlensEngineClient | None = None
    originals: dict[str, Endpoint] = field(default_factory=dict)


SERVING = Serving()

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
ACTIVATIONS = "/v1/activations/{activation_id}"
STATUS = "/v1/vlens/status"

SHUTTING_DOWN = ("the server is shutting down: this request was not finished (vlens serve "
                 "--shutdown-timeout SECONDS lets requests in flight finish first)")


class VlensRoutes:
    """The endpoint plugin (vLLM calls this class with no arguments)."""

    name = "vlens"
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        """Our routes replace vLLM's completion routes (whose handlers they call, with the same
        dependencies, such as its check of the content type) and add the activations route."""
        handlers = {COMPLETIONS: completions, CHAT: chat_completions}
        for index, route in enumerate(list(app.router.routes)):
            ours = route.path in handlers if isinstance(route, APIRoute) else False
            if ours and route.methods == {"POST"}:
                SERVING.originals[route.path] = route.endpoint
                app.router.add_api_route(
                    route.path, handlers[route.path], methods=["POST"],
                    dependencies=list(route.dependencies), route_class_override=VlensRoute,
                )
                # In the original's place (vLLM 0.26 would keep the first of two routes)
                app.router.routes[index] = app.router.routes.pop()
        if COMPLETIONS not in SERVING.originals:  # vlens fields would be silently ignored
            raise RuntimeError(
                f"vlens serve: this vLLM has no POST {COMPLETIONS} route of the expected form "
                "for vlens to extend"
            )
        app.add_api_route(ACTIVATIONS, activations, methods=["GET"])
        app.add_api_route(STATUS, status, methods=["GET"])

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        """Nothing: ``vlens serve`` hands its engine client to vLLM's handlers itself."""


async def completions(request: CompletionRequest, raw_request: Request) -> Response:
    return await _with_vlens_fields(COMPLETIONS, request, raw_request)


async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
    return await _with_vlens_fields(CHAT, request, raw_request)


async def activations(activation_id: str) -> Response:
    client = _client()
    payload = client.captures.take(activation_id)
    if payload is None:
        return _error(
            404, f"no activations with id {activation_id!r}: each is served once, and the "
            "oldest are dropped when new ones need the room (--capture-bytes)", "id"
        )
    return Response(payload, media_type="application/octet-stream")


async def status() -> Response:
    """What the server holds (:meth:`VlensEngineClient.status`): for watching a long-running
    server, and for the tests that it forgets what it should."""
    return JSONResponse(await _client().status())


async def _with_vlens_fields(path: str, request: Any, raw_request: Request) -> Response:
    """Every completion request, counted in flight until its response (a stream: its last
    event) is written, and answered with a 503 once the server is shutting down."""
    client = _client()
    if client.stopping:
        return _shutting_down()
    client.enter()
    try:
        response = await _answer(path, request, raw_request, client)
    except BaseException:
        client.leave()
        raise
    if isinstance(response, StreamingResponse):
        response.body_iterator = _until_stopped(response.body_iterator, client)
    else:
        client.leave()
    return response


async def _answer(
    path: str, request: Any, raw_request: Request, client: VlensEngineClient
) -> Response | None:
    reserved = sorted({TAG_KEY, FIELDS_KEY, INLINE_KEY} & set(request.vllm_xargs or {}))
    if reserved:  # a request must not pose as another one's rows
        message = f"vllm_xargs: {reserved} are reserved by vlens; use the vlens field"
        return _error(400, message, "vllm_xargs")
    value = with_steered_model(vlens_field(raw_request), client.steered_models.get(request.model))
    original = SERVING.originals[path]
    if value is None:
        return await _vllm_answer(original, request, raw_request, client)
    try:
        fields = read_fields(value, client.vectors)
        planned = client.served.plan(fields)
        _check_request(request, bool(fields.capture))
    except BadVlensField as error:
        return _error(400, str(error), "vlens")
    ticket = client.admit(planned)
    request.vllm_xargs = {**(request.vllm_xargs or {}), FIELDS_KEY: ticket}
    try:
        response = await _vllm_answer(original, request, raw_request, client)
    except BaseException:
        client.release(ticket)
        raise
    if isinstance(response, StreamingResponse):  # generated while the body is sent
        body = response.body_iterator
        if fields.capture:
            body = _captures_before_done(body, path, client)
        response.body_iterator = _released_after(body, client, ticket)
        return response
    client.release(ticket)
    if (  # None: the client went away (vLLM's handler answers nothing then)
        response is None or not fields.capture or response.status_code != 200
        or not isinstance(response, JSONResponse)
    ):
        return response
    body = json.loads(response.body)
    for choice in body.get("choices", []):
        field = _claim_capture(client, path, body["id"], choice["index"], _samples(request))
        if field is not None:
            choice["vlens"] = field
    if len(body.get("choices", [])) == 1 and "vlens" in body["choices"][0]:
        body["vlens"] = body["choices"][0]["vlens"]
    headers = {k: v for k, v in response.headers.items() if k.lower() != "content-length"}
    return JSONResponse(body, status_code=response.status_code, headers=headers)


async def _vllm_answer(
    original: Endpoint, request: Any, raw_request: Request, client: VlensEngineClient
) -> Response | None:
    """vLLM's handler's response, or a 503 where the server stops first."""
    response = await client.until_stopped(original(request=request, raw_request=raw_request))
    return _shutting_down() if response is STOPPED else response


async def _until_stopped(
    chunks: AsyncIterator[str | bytes], client: VlensEngineClient
) -> AsyncIterator[str | bytes]:
    """A streamed response's events, ended with an error event where the server stops first;
    the request leaves those in flight when they end."""
    iterator = aiter(chunks)
    try:
        while True:
            try:
                chunk = await client.until_stopped(anext(iterator))
            except StopAsyncIteration:
                return
            if chunk is STOPPED:
                yield f"data: {json.dumps(_error_body(503, SHUTTING_DOWN, 'server'))}\n\n"
                yield "data: [DONE]\n\n"
                return
            yield chunk
    finally:
        client.leave()


async def _released_after(
    chunks: AsyncIterator[str | bytes], client: VlensEngineClient, ticket: str
) -> AsyncIterator[str | bytes]:
    """A streamed response's events; its ticket released once they end (or the client left)."""
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        client.release(ticket)


async def _captures_before_done(
    chunks: AsyncIterator[str | bytes], path: str, client: VlensEngineClient
) -> AsyncIterator[str | bytes]:
    """A streamed response's events, with one more before ``data: [DONE]``: no choices, and the
    ``vlens`` field of the request's capture (stored by then: the engine client finishes the
    request before vLLM's stream ends)."""
    first: dict | None = None
    async for chunk in chunks:
        text = chunk.decode() if isinstance(chunk, bytes) else chunk
        if first is None and text.startswith("data: {"):
            first = json.loads(text[len("data: "):])
        if text.strip() == "data: [DONE]" and first is not None:
            field = _claim_capture(client, path, first["id"], 0, 1)
            if field is not None:
                final = {part: first[part] for part in ("id", "object", "created", "model")}
                yield f"data: {json.dumps({**final, 'choices': [], 'vlens': field})}\n\n"
        yield chunk


def _claim_capture(
    client: VlensEngineClient, path: str, response_id: str, index: int, samples: int
) -> dict[str, Any] | None:
    """The ``vlens`` field of choice ``index`` of a response, taken from what the engine client
    kept under the request id vLLM's handler gave that choice's engine request (completions:
    ``{response id}-{prompt index}``; chat: the response id), and the choice's sample where the
    request asked for ``samples`` > 1 (choice ``index`` is sample ``index % samples`` of prompt
    ``index // samples``)."""
    prompt, sample = divmod(index, samples)
    request_id = f"{response_id}-{prompt}" if path == COMPLETIONS else response_id
    captured = client.captured.pop(sample_key(request_id, sample, samples), None)
    if captured is None:
        return None
    return {"activations": captured.activations, "names": captured.names}


def with_steered_model(value: Any, steered_model: dict | None) -> Any:
    """A request's ``vlens`` object with its model name's (``--steered-model``) before it: the
    model's steering first, then the request's own, and the request's captures."""
    if steered_model is None or value is None:
        return value if steered_model is None else steered_model
    if not isinstance(value, dict) or not isinstance(value.get("steering", []), list):
        return value  # refused as it is by read_fields
    steering = [*steered_model.get("steering", []), *value.get("steering", [])]
    return {**steered_model, **value, "steering": steering}


def _check_request(request: Any, captures: bool) -> None:
    """What a request with ``vlens`` fields cannot combine them with."""
    if captures and getattr(request, "stream", False) and _samples(request) > 1:
        raise BadVlensField(
            "a streamed request that captures takes n=1 (its capture comes in the stream's "
            "last event); send n requests, or stream: false"
        )
    if getattr(request, "use_beam_search", False):
        raise BadVlensField("vlens fields cannot be combined with beam search")
    prompt = getattr(request, "prompt", None)
    several = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
    if captures and getattr(request, "stream", False) and several and len(prompt) > 1:
        raise BadVlensField(
            "a streamed request that captures takes one prompt (its capture comes in the "
            "stream's last event); send one request per prompt, or stream: false"
        )


def _samples(request: Any) -> int:
    return getattr(request, "n", 1) or 1


def _client() -> VlensEngineClient:
    if SERVING.client is None:
        raise RuntimeError("vlens's routes are served by `vlens serve` only")
    return SERVING.client


def _error(status: int, message: str, param: str) -> JSONResponse:
    return JSONResponse(_error_body(status, message, param), status_code=status)


def _error_body(status: int, message: str, param: str) -> dict[str, Any]:
    kinds = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}
    return {"error": {"message": message, "type": kinds[status], "param": param, "code": status}}


def _shutting_down() -> JSONResponse:
    return _error(503, SHUTTING_DOWN, "server")
