"""Steering that travels inside a served request, so that the workers need no call of their own.

A request that only steers, on a compiled engine (its steering applied by the graph, nothing
captured, no hook function), needs nothing from the workers but its steers while it runs, and
nothing back. The server puts them in the request's ``SamplingParams.extra_args`` under
:data:`INLINE_KEY`, as plain data (numbers, strings, and vectors as float32 bytes: nothing is
unpickled), and each worker takes them from the scheduler's new requests before the step that
first runs the request, and forgets the request when the scheduler reports it finished
(:class:`InlineSteering`). Requests that capture keep the server's calls to the workers, which
hand their rows back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from vlens.runtime.messages import RequestPlan
from vlens.runtime.steering import (
    AnySteer,
    SAESteer,
    Steer,
    positions_as_data,
    positions_from_data,
)

#: The ``extra_args`` key of a request's steers (the routes refuse it from clients).
INLINE_KEY = "vlens_steering"


def encode(steers: Sequence[AnySteer]) -> list[dict[str, Any]]:
    """``steers`` as plain data that vLLM's request serialisation carries."""
    return [_encode_one(steer) for steer in steers]


def decode(value: list[dict[str, Any]]) -> tuple[AnySteer, ...]:
    """The steers :func:`encode` wrote."""
    return tuple(_decode_one(entry) for entry in value)


def _encode_one(steer: AnySteer) -> dict[str, Any]:
    positions = positions_as_data(steer.positions)
    if isinstance(steer, SAESteer):
        multipliers, offsets = steer.multipliers_and_offsets()
        return {"sae": steer.sae, "features": [int(f) for f in steer.features],
                "scale": multipliers, "add": offsets, "positions": positions}
    gain = steer.gain if not isinstance(steer.gain, Tensor) else _bytes(steer.gain)
    return {"name": steer.name, "add": _bytes(steer.add), "scale": float(steer.scale),
            "ablate": _bytes(steer.ablate), "gain": gain, "positions": positions}


def _decode_one(entry: dict[str, Any]) -> AnySteer:
    positions = positions_from_data(entry["positions"])
    if "sae" in entry:
        return SAESteer(entry["sae"], entry["features"], scale=entry["scale"], add=entry["add"],
                        positions=positions)
    gain = entry["gain"]
    return Steer(entry["name"], add=_tensor(entry["add"]), scale=entry["scale"],
                 ablate=_tensor(entry["ablate"]),
                 gain=_tensor(gain) if isinstance(gain, bytes) else gain, positions=positions)


def _bytes(value: Tensor | None) -> bytes | None:
    if value is None:
        return None
    return value.detach().to("cpu", torch.float32).contiguous().reshape(-1).numpy().tobytes()


def _tensor(value: bytes | None) -> Tensor | None:
    if value is None:
        return None
    return torch.frombuffer(bytearray(value), dtype=torch.float32)


class InlineSteering:
    """A worker's part: the requests it follows from their inline steers, by vLLM request id."""

    def __init__(self) -> None:
        self.tags: dict[str, str] = {}

    @staticmethod
    def carried(scheduler_output: Any) -> bool:
        """Whether a step's scheduler output holds any new request with inline steers."""
        return any(
            INLINE_KEY in (getattr(new.sampling_params, "extra_args", None) or {})
            for new in scheduler_output.scheduled_new_reqs
        )

    def new_plans(self, scheduler_output: Any, tag_of: Any) -> dict[str, RequestPlan]:
        """The plans of the step's new requests that carry steers, by tag."""
        plans = {}
        for new in scheduler_output.scheduled_new_reqs:
            extra = getattr(new.sampling_params, "extra_args", None) or {}
            if INLINE_KEY not in extra or new.req_id in self.tags:
                continue
            tag = tag_of(new.sampling_params)
            self.tags[new.req_id] = tag
            plans[tag] = RequestPlan(0, {}, steering=decode(extra[INLINE_KEY]))
        return plans

    def finished(self, scheduler_output: Any) -> list[str]:
        """The tags of the inline requests the scheduler reports finished (or aborted)."""
        return [self.tags.pop(req_id) for req_id in scheduler_output.finished_req_ids
                if req_id in self.tags]
