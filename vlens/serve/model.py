"""The served model's names, on the API server's side: plans for requests, activations from
what the workers hand back.

vLLM's OpenAI server runs the engine in a process of its own; the API server process holds what
``HookedVLLM`` holds apart from the engine (the mapping's names, the planner, the checkpoint's
weights for derived names), so that each request is planned and its captured values assembled
exactly as ``run_with_cache`` and ``generate`` do it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from vlens.engine.cache import assemble
from vlens.engine.link import Run
from vlens.hooked.model import HookedVLLM, checkpoint_of
from vlens.names.compiled import CompiledNames
from vlens.names.resolve import select_names
from vlens.runtime.inline import carried, encode
from vlens.runtime.messages import Handback, HookError, RequestPlan
from vlens.serve.fields import BadVlensField, VlensFields


@dataclass(frozen=True)
class Planned:
    """One request's plan, with the names it captures (``names``) and reads at sites (``kept``)."""

    plan: RequestPlan
    names: tuple[str, ...]
    kept: tuple[str, ...]
    #: the plan as the request carries it to the workers (:mod:`vlens.runtime.inline`), where
    #: the graph does all it asks; None: the server calls the workers to start it
    inline: dict | None = None


class _EngineElsewhere:
    """Stands for the engine in the API server process: the engine runs in vLLM's engine
    process, reached through the server's engine client, never through this object."""

    def __init__(self, tensor_parallel_size: int) -> None:
        self.tensor_parallel_size = tensor_parallel_size


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
        model = checkpoint_of(path, compiled_capture, compiled_steering, engine_args or {},
                              (), dict(saes or {}), sae_slots, sae_top_k)
        self.compiled: CompiledNames | None = model.compiled
        self.mapping = model.mapping
        ranks = int((engine_args or {}).get("tensor_parallel_size", 1))
        self.model = HookedVLLM(
            _EngineElsewhere(ranks),  # type: ignore[arg-type]
            Path(path),
            model.config,
            model.tokenizer,
            model.mapping,
            model.compiled,
        )

    @property
    def graph_names(self) -> tuple:
        return self.compiled.graph_names if self.compiled else ()

    def plan(self, fields: VlensFields) -> Planned:
        """The request's plan; whatever this engine cannot serve raises :class:`BadVlensField`."""
        model = self.model
        try:
            names: list[str] = []
            if fields.capture:
                known = list(model.hook_specs)
                names = select_names(list(fields.capture), known, model.explain)
            kept = model.planner.site_names(names)
            model.planner.check_graph_reads(kept, None)
            steers = model.planner.steering(fields.steering, None, 1)
            plan = model.planner.plans(kept, [{}], steers, {})[0]
        except (KeyError, ValueError, TypeError, NotImplementedError) as error:
            message = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
            raise BadVlensField(str(message)) from None
        inline = encode(plan) if self.compiled is not None and carried(plan) else None
        return Planned(plan, tuple(names), tuple(kept), inline)

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
        names = list(planned.names)
        _, cache = assemble(
            self.model, run, [prompt], True, names, names, list(planned.kept), torch.device("cpu")
        )
        return {name: cache[name][0].contiguous() for name in names}
