"""How vlens's routes read a request's JSON body: with msgspec, and its ``vlens`` object apart.

FastAPI reads a route's JSON body with ``json.loads``, whose float parsing costs ~1.8 ms for a
4,096-number steering vector on this machine's CPU (msgspec: ~0.2 ms). On a busy server that is
the API process's time, which bounds the throughput of every request. A body msgspec refuses
(``NaN``, lone surrogates, numbers out of its range) is read by ``json.loads`` after all, so any
body is read as FastAPI would, errors included. The ``vlens`` object is taken out before vLLM's
request model validates the rest (which would keep it as an extra field and list it, at debug
level, among the fields it ignores) and kept in the request's state, :data:`FIELD`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec
from fastapi import Request, Response
from fastapi.routing import APIRoute

#: The request state's attribute holding the body's ``vlens`` object (None: the body has none).
FIELD = "vlens_field"


class VlensRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                value = msgspec.json.decode(body)
            except msgspec.DecodeError:
                value = json.loads(body)
            field = value.pop("vlens", None) if isinstance(value, dict) else None
            setattr(self.state, FIELD, field)
            self._json = value
        return self._json


class VlensRoute(APIRoute):
    """A route whose handler reads its body as :class:`VlensRequest` does."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def read_body(request: Request) -> Response:
            return await handler(VlensRequest(request.scope, request.receive))

        return read_body


def vlens_field(request: Request) -> Any:
    """The ``vlens`` object of a request read by a :class:`VlensRoute` (None where it has none)."""
    return getattr(request.state, FIELD, None)
