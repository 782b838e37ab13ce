"""A served request's plan that travels inside the request, so that the workers need no call to
start following it.

A request on a compiled engine that only steers (its steering applied by the graph) and captures
only traced names (no hook function, no attention computed for it) needs nothing from the workers
but its plan while it runs. The server puts the plan in the request's
``SamplingParams.extra_args`` under :data:`INLINE_KEY`, as plain data (numbers, strings, and
vectors as float32 bytes: nothing is unpickled), and each worker takes it from the scheduler's new
requests before the step that first runs the request (:class:`InlineRequests`). A request that
only steers is forgotten when the scheduler reports it finished: it needs no call at all. A
request that captures is finished by the server's one call, which hands its rows back.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from vlens.runtime.transfer.messages import RequestPlan
from vlens.runtime.vocabulary.steering import (
    AnySteer,
    SAESteer,
    Steer,
    positions_as_data,
    positions_from_data,
)

#: The ``extra_args`` key of a request's plan (the routes refuse it from clients).
INLINE_KEY = "vlens_plan"


def carried(plan: RequestPlan) -> bool:
    """Whether a served request of ``plan`` can carry it (on a compiled engine)."""
    return not plan.sites and not plan.attention and bool(plan.steering or plan.graph_keep)


def encode(plan: RequestPlan) -> dict[str, Any]:
    """``plan`` (one that :func:`carried` accepts) as plain data that vLLM's request
    serialisation carries."""
    return {"steering": [_encode_one(steer) for steer in plan.steering],
            "keep": sorted(plan.graph_keep)}


def decode(value: dict[str, Any]) -> RequestPlan:
    """The plan :func:`encode` wrote."""
    steering = tuple(_decode_one(entry) for entry in value["steering"])
    return RequestPlan(0, {}, graph_keep=frozenset(value["keep"]), steering=steering)


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


class InlineRequests:
    """A worker's part: the requests it follows from the plans they carry, by vLLM request id."""

    def __init__(self) -> None:
        self.tags: dict[str, str] = {}

    @staticmethod
    def carried(scheduler_output: Any) -> bool:
        """Whether a step's scheduler output holds any new request that carries its plan."""
        return any(
            INLINE_KEY in (getattr(new.sampling_params, "extra_args", None) or {})
            for new in scheduler_output.scheduled_new_reqs
        )

    def new_plans(self, scheduler_output: Any, tag_of: Any) -> dict[str, RequestPlan]:
        """The plans of the step's new requests that carry them, by tag."""
        plans = {}
        for new in scheduler_output.scheduled_new_reqs:
            extra = getattr(new.sampling_params, "extra_args", None) or {}
            if INLINE_KEY not in extra or new.req_id in self.tags:
                continue
            tag = tag_of(new.sampling_params)
            self.tags[new.req_id] = tag
            plans[tag] = decode(extra[INLINE_KEY])
        return plans

    def finished(self, scheduler_output: Any) -> list[str]:
        """The tags of the requests the scheduler reports finished (or aborted)."""
        return [self.tags.pop(req_id) for req_id in scheduler_output.finished_req_ids
                if req_id in self.tags]
