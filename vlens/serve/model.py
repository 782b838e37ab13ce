"""The served model's names, on the API server's side: plans for requests, activations from
what the workers hand back.

vLLM's OpenAI server runs the engine in a process of its own; the API server process holds the
checkpoint (:class:`~vlens.engine.checkpoint.Checkpoint`: the mapping's names, the planner, the
checkpoint's weights for derived names), so that each request is planned and its captured values
assembled exactly as ``run_with_cache`` and ``generate`` do it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from vlens.engine.assembly import assemble
from vlens.engine.checkpoint import Checkpoint
from vlens.engine.engine import Run
from vlens.engine.planning import CallPlan
from vlens.runtime.compiled.inline import carried, encode
from vlens.runtime.transfer.messages import Handback, HookError, RequestPlan
from vlens.serve.fields import BadVlensField, VlensFields, check_range


@dataclass(frozen=True)
class Planned:
    """One request's plan, as the one-prompt call it is (what it captures, what it reads at
    sites)."""

    call: CallPlan
    #: the plan as the request carries it to the workers (:mod:`vlens.runtime.compiled.inline`),
    #: where the graph does all it asks; None: the server calls the workers to start it
    inline: dict | None = None

    @property
    def plan(self) -> RequestPlan:
        return self.call.plans[0]

    @property
    def names(self) -> list[str]:
        """The names the request captures."""
        return self.call.names


class ServedModel:
    """Names, plans and activations of the model a server serves."""

    def __init__(
        self,
        path: str | Path,
        compiled_capture: Sequence[str] = (),
        compiled_steering: Sequence[str] = (),
        engine_args: dict[str, Any] | None = None,
        saes: dict[str, Path] | None = None,
        sae_slots: int = 1024,
        sae_top_k: int | None = None,
    ) -> None:
        self.checkpoint = Checkpoint.load(
            path, engine_args or {}, compiled_capture, compiled_steering, (), dict(saes or {}),
            sae_slots, sae_top_k,
        )
        self.dtype = served_dtype(engine_args or {}, self.checkpoint.hf_config)

    def plan(self, fields: VlensFields) -> Planned:
        """The request's plan; whatever this engine cannot serve raises :class:`BadVlensField`."""
        check_range(fields.steering, self.dtype)
        try:
            call = self.checkpoint.planner.call(1, list(fields.capture), steering=fields.steering)
        except (KeyError, ValueError, TypeError, NotImplementedError) as error:
            message = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
            raise BadVlensField(str(message)) from None
        plan = call.plans[0]
        inline = encode(plan) if self.checkpoint.compiled is not None and carried(plan) else None
        return Planned(call, inline)

    def activations(
        self, planned: Planned, tag: str, handback: Handback, prompt: list[int], sampled: list[int]
    ) -> dict[str, Tensor]:
        """Each captured name's values over the request's positions (prompt and generated
        tokens but the last, which never ran through the model): ``{name: [pos, ...]}``."""
        capture = handback.captures[tag]
        if capture.error is not None:
            raise HookError(capture.error) from capture.cause
        if not planned.names:
            return {}
        run = Run([capture], handback.padded, [sampled], [None])
        assembled = assemble(self.checkpoint, planned.call, run, [prompt], True, torch.device("cpu"))
        return {name: assembled.cached[name][0].contiguous() for name in planned.names}


def served_dtype(engine_args: dict[str, Any], config: Any) -> torch.dtype:
    """The dtype the engine computes in: ``--dtype``, else the checkpoint's own (float32 where
    it names none)."""
    named = engine_args.get("dtype", "auto")
    if isinstance(named, torch.dtype):
        return named
    if named in (None, "auto"):
        named = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    if isinstance(named, torch.dtype):
        return named
    aliases = {"half": "float16", "float": "float32", "bfloat": "bfloat16"}
    dtype = getattr(torch, aliases.get(str(named), str(named)), None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32
