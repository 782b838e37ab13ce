"""Running a user's TransformerLens hook function on one request's rows, and writing its edit back.

The function sees TransformerLens's value for one request, ``[1, pos, ...]`` (``pos`` = this
request's rows in this engine step: the prompt, a prefill chunk, or one decode row), as a tensor
of its own. It may return a replacement, or edit the tensor in place and return None: either way
the edit is written into vLLM's tensors through the name's write rule, so the model computes on
with it and every later name sees it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from einops import rearrange
from torch import Tensor

from vlens.readers import writable
from vlens.runtime.layout import RequestRows
from vlens.runtime.plan import HookFunction, NamePlan
from vlens.runtime.sites import NarrowedCall


class HookError(RuntimeError):
    """A user's hook function failed, or returned something vlens cannot write back."""


@dataclass
class Hook:
    """The ``hook`` argument of a hook function: TransformerLens's ``HookPoint`` surface
    (``name``, ``layer()``, ``ctx``) plus where these rows sit.

    ``request`` is the prompt's index in the call; ``is_prefill`` False on decode steps;
    :attr:`positions` the absolute sequence positions of its ``length`` rows, from
    ``first_position`` on, on the value's ``device``.
    """

    name: str
    request: int
    first_position: int
    length: int
    is_prefill: bool
    device: torch.device
    ctx: dict[str, Any] = field(default_factory=dict)

    @cached_property
    def positions(self) -> Tensor:
        """Made when first asked for (most hooks never do), where the value is, so that
        ``x[:, hook.positions >= 5]`` works on a GPU as on the CPU."""
        end = self.first_position + self.length
        return torch.arange(self.first_position, end, device=self.device)

    def layer(self) -> int:
        found = re.match(r"blocks\.(\d+)\.", self.name)
        if found is None:
            raise ValueError(f"{self.name} is not inside a block: it has no layer")
        return int(found.group(1))


def tensor_for_hook(plan: NamePlan, value: Tensor) -> Tensor:
    """``[pos, ...]`` rows → the ``[1, ...]`` tensor a TransformerLens hook expects."""
    batched = value.unsqueeze(0)
    return batched if plan.arrange is None else rearrange(batched, plan.arrange).contiguous()


def rows_from_hook(plan: NamePlan, value: Tensor) -> Tensor:
    """The inverse of :func:`tensor_for_hook`."""
    if plan.arrange is not None:
        source, target = plan.arrange.split("->")
        value = rearrange(value, f"{target} -> {source}")
    return value.squeeze(0)


def run_hooks(
    plan: NamePlan,
    call: NarrowedCall,
    rows: RequestRows,
    index: int,
    contexts: dict[str, dict[str, Any]],
) -> None:
    """Run ``plan.hooks`` in order on this request's value of ``plan.name`` and write back."""
    original = plan.read(call)
    # In-place edits bump a tensor's version counter: telling an edit from a look this way costs
    # no comparison (on a GPU, no device-to-host sync per request). vLLM runs the forward in
    # inference mode, whose tensors keep no counter, so the hook's copy is made outside it.
    with torch.inference_mode(False):
        value = tensor_for_hook(plan, original.clone())
    version, replaced = value._version, False
    hook = Hook(
        name=plan.name,
        request=index,
        first_position=rows.first_position,
        length=rows.stop - rows.start,
        is_prefill=rows.is_prefill,
        device=value.device,
        ctx=contexts.setdefault(plan.name, {}),
    )
    for function in plan.hooks:
        returned = _call(function, value, hook)
        if returned is not None:
            _check(returned, value, plan.name, function)
            value, replaced = returned, True
    if not replaced and value._version == version:
        return
    if not writable(plan.read):
        raise HookError(
            f"a hook on {plan.name} changed its value, but {plan.name} cannot be written back "
            f"into vLLM (it is computed from the model's tensors, not one of them): hook a name "
            f"that feeds it instead"
        )
    plan.read.write(call, rows_from_hook(plan, value).to(original.dtype))


def _call(function: HookFunction, value: Tensor, hook: Hook) -> Tensor | None:
    try:
        return function(value, hook)
    except Exception as error:
        name = getattr(function, "__qualname__", repr(function))
        raise HookError(f"hook function {name} on {hook.name} raised {error!r}") from error


def _check(returned: Any, value: Tensor, name: str, function: HookFunction) -> None:
    label = f"hook function {getattr(function, '__qualname__', repr(function))} on {name}"
    if not isinstance(returned, Tensor):
        raise HookError(f"{label} returned {type(returned).__name__}; return a tensor or None")
    if returned.shape != value.shape:
        raise HookError(
            f"{label} returned shape {tuple(returned.shape)}; expected {tuple(value.shape)}"
        )
    if returned.dtype != value.dtype:
        raise HookError(f"{label} returned dtype {returned.dtype}; expected {value.dtype}")
