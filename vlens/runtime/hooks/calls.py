"""Running a user's TransformerLens hook functions on the rows of a step and writing their edit
back.

A function sees TransformerLens's value as a tensor of its own: the call's padded batch,
``[batch, pos, ...]``, for the functions every prompt of the call shares, or one prompt's
``[1, pos, ...]`` for its own (:mod:`vlens.runtime.hooks.batches`). It may return a replacement, or
edit the tensor in place and return None: either way the edit is written into vLLM's tensors
through the name's write rule, so the model computes on with it and every later name sees it.
The rows are read once and written once (one span of the step's rows, or its rows gathered), so
a hook function costs about the same for one prompt as for hundreds.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from einops import rearrange
from torch import Tensor

from vlens.runtime.hooks.batches import HookBatch
from vlens.runtime.sites.torch_hooks import NarrowedCall
from vlens.runtime.transfer.messages import HookError, HookFunction, NamePlan
from vlens.runtime.vocabulary.readers import writable


@dataclass
class Hook:
    """The ``hook`` argument of a hook function: TransformerLens's ``HookPoint`` surface
    (``name``, ``layer()``, ``ctx``) plus where the value's rows sit.

    ``requests`` are the indices in the call of the prompts on the value's batch axis, in
    order; ``request`` the index when the value is one prompt's, None for the call's batch.
    ``is_prefill`` False on decode steps. The value's positions axis is ``length`` long; prompt
    ``i`` holds ``lengths[i]`` real rows there, from sequence position ``first_positions[i]``
    on, at the start of the axis (``padding_side="right"``) or its end (``"left"``); the rest is
    padding: zeros, and edits there go nowhere. :attr:`attention_mask` (``[batch, pos]``, True
    at real rows) and :attr:`positions` (each row's sequence position, -1 at padding) are made
    on the value's ``device`` when first asked for.
    """

    name: str
    request: int | None
    first_positions: tuple[int, ...]
    length: int
    is_prefill: bool
    device: torch.device
    ctx: dict[str, Any] = field(default_factory=dict)
    requests: tuple[int, ...] = ()
    lengths: tuple[int, ...] = ()
    padding_side: str = "right"

    @property
    def first_position(self) -> int:
        """The position of the first row, where every prompt of the value starts there."""
        if len(set(self.first_positions)) > 1:
            raise ValueError(
                f"the prompts of this batch are at different positions {self.first_positions} "
                f"(prompts of different lengths, or not every prompt in this step): use "
                f"hook.first_positions (one per prompt, in batch order, -1 for a prompt with no "
                f"rows here) or hook.positions ([batch, pos], -1 at padding)"
            )
        return self.first_positions[0]

    @cached_property
    def attention_mask(self) -> Tensor:
        """``[batch, pos]``, True at each prompt's real rows, False at padding (as
        ``cache.attention_mask`` for a cache)."""
        offsets = torch.arange(self.length, device=self.device)
        lengths = torch.tensor(self.lengths, device=self.device)[:, None]
        if self.padding_side == "left":
            return offsets >= self.length - lengths
        return offsets < lengths

    @cached_property
    def positions(self) -> Tensor:
        """``[batch, pos]``: each row's sequence position (-1 at padding), beside the value's
        ``[batch, pos]`` axes, so that ``x[hook.positions >= 5] += v`` edits those rows whether
        the prompts sit at the same positions or not."""
        offsets = torch.arange(self.length, device=self.device)
        if self.padding_side == "left":
            offsets = offsets - (self.length - torch.tensor(self.lengths, device=self.device))[:, None]
        first = torch.tensor(self.first_positions, device=self.device)[:, None]
        return torch.where(self.attention_mask, first + offsets, -1)

    def layer(self) -> int:
        found = re.match(r"blocks\.(\d+)\.", self.name)
        if found is None:
            raise ValueError(f"{self.name} is not inside a block: it has no layer")
        return int(found.group(1))


def arranged(plan: NamePlan, batched: Tensor) -> Tensor:
    """``[batch, pos, ...]`` in the layout TransformerLens gives the name (e.g. heads first)."""
    if plan.arrange is None:
        return batched
    with torch.inference_mode(False):
        return rearrange(batched, plan.arrange).contiguous()


def rows_from_hook(plan: NamePlan, value: Tensor) -> Tensor:
    """The inverse of :func:`arranged`: ``[batch, pos, ...]``, one request's rows per item."""
    if plan.arrange is not None:
        source, target = plan.arrange.split("->")
        value = rearrange(value, f"{target} -> {source}")
    return value


def run_hooks(
    plan: NamePlan,
    functions: tuple[HookFunction, ...],
    batch: HookBatch,
    whole: NarrowedCall,
    contexts: dict[str, dict[str, Any]],
) -> None:
    """Run ``functions`` in order on the value of ``plan.name`` laid out as ``batch`` says
    (``whole``: the site's call over the whole step), and write the edit of its real rows back.
    The rows are read once and written once (:func:`batch_call`), whatever their number."""
    call = batch_call(whole, batch)
    original = plan.read(call)
    value = arranged(plan, batch.padded(original))
    hook = hook_point(plan.name, batch, value.device, contexts)
    value, edited = call_hooks(functions, value, hook)
    if not edited:
        return
    if not writable(plan.read):
        raise HookError(
            f"a hook on {plan.name} changed its value, but {plan.name} cannot be written back "
            f"into vLLM (it is computed from the model's tensors, not one of them): hook a name "
            f"that feeds it instead"
        )
    plan.read.write(call, batch.unpadded(rows_from_hook(plan, value)).to(original.dtype))


Refusal = Callable[[str, Sequence[HookFunction], HookBatch], None]


def run_hooks_together(
    plan: NamePlan,
    batches: Sequence[HookBatch],
    whole: NarrowedCall,
    contexts: dict[str, dict[str, Any]],
) -> dict[int, HookError]:
    """:func:`run_hooks` of ``plan.hooks`` for several requests of one step with the same own
    hook functions at ``plan.name`` (one :class:`HookBatch` each): the value of all their rows
    is read once, copied once and, if some function edited it, written back once; each
    request's functions run on a view of its own rows, as they would alone. Returns the
    failures by ``id`` of the batch; a failed batch's rows are written back as they were."""
    if plan.arrange is not None or not writable(plan.read):
        return _one_by_one(plan, batches, whole, contexts)
    rows = [own for batch in batches for own in batch.rows]
    together = HookBatch(rows, tuple(range(len(rows))), len(rows), ())
    call = batch_call(whole, together)
    original = plan.read(call)
    value = hook_copy(original)
    version = value._version
    failures: dict[int, HookError] = {}
    start = 0
    for batch in batches:
        part_rows = slice(start, start + batch.length)
        start = part_rows.stop
        part = value[part_rows].unflatten(0, (1, batch.length))
        try:
            hook = hook_point(plan.name, batch, value.device, contexts)
            result, _ = call_hooks(plan.hooks, part, hook)
            if result is not part:
                part.copy_(result)
        except HookError as error:
            failures[id(batch)] = error
            part.copy_(original[part_rows].unflatten(0, part.shape[:2]))
    if value._version != version:
        plan.read.write(call, value)
    return failures


def _one_by_one(
    plan: NamePlan,
    batches: Sequence[HookBatch],
    whole: NarrowedCall,
    contexts: dict[str, dict[str, Any]],
) -> dict[int, HookError]:
    """:func:`run_hooks_together` where the value cannot be viewed per request (a name
    TransformerLens arranges otherwise) or written back (then only the request that edits
    fails)."""
    failures: dict[int, HookError] = {}
    for batch in batches:
        try:
            run_hooks(plan, plan.hooks, batch, whole, contexts)
        except HookError as error:
            failures[id(batch)] = error
    return failures


def refuse_part_of_a_prefill(
    name: str, functions: Sequence[HookFunction], batch: HookBatch
) -> None:
    """A hook function shared by a call's prompts is TransformerLens's: it sees each prompt's
    whole prefill at once, and may index it at absolute positions. The engine refuses a call
    whose prompts cannot prefill in one step before it runs (``Engine.check_whole_prefill``);
    should vLLM still split a prefill over steps, running the function on a step's part would
    edit the wrong rows: refused instead."""
    split = batch.split_prefill
    if split is None:
        return
    index, own = split
    rows_run = own.stop - own.start
    raise HookError(
        f"hook function {function_name(functions[0])} on {name}: vLLM split prompt {index}'s "
        f"prefill ({own.prompt_length} tokens) over engine steps, so this step holds only its "
        f"positions {own.first_position}-{own.first_position + rows_run - 1}, where "
        f"TransformerLens hands a hook the whole prompt. Build the model without "
        f"max_num_batched_tokens (vlens then prefills every prompt in one step) or with "
        f"max_num_batched_tokens >= {own.prompt_length}; or pass the function in prompt_hooks, "
        f"whose functions see each step's rows (hook.positions)"
    )


def batch_call(whole: NarrowedCall, batch: HookBatch) -> NarrowedCall:
    """The site's call narrowed to the rows of ``batch``, in its order: views of one span where
    they are consecutive rows of the step in this order (the usual case on vLLM's persistent
    batch, and always for one request); else their rows gathered by index."""
    if batch.span is not None:
        return dataclasses.replace(whole, rows=batch.span)
    return dataclasses.replace(whole, index=batch.index(step_device(whole)))


def step_device(call: NarrowedCall) -> torch.device:
    """Where the step's tensors are."""
    results = call.result if isinstance(call.result, tuple) else (call.result,)
    for value in (*results, *call.args, *call.kwargs.values()):
        if isinstance(value, Tensor):
            return value.device
    raise HookError("a module call with no tensor: nothing to run a hook function on")


def hook_copy(value: Tensor) -> Tensor:
    """``value`` as the hook function's own tensor. In-place edits bump a tensor's version
    counter: telling an edit from a look this way costs no comparison (on a GPU, no
    device-to-host sync per request). vLLM runs the forward in inference mode, whose tensors keep
    no counter, so the copy is made outside it."""
    with torch.inference_mode(False):
        return value.clone()


def hook_point(
    name: str, batch: HookBatch, device: torch.device, contexts: dict[str, dict[str, Any]]
) -> Hook:
    """The ``hook`` argument for the value ``batch`` lays out at ``name``."""
    return Hook(
        name=name,
        request=batch.request,
        first_positions=batch.first_positions,
        length=batch.length,
        is_prefill=batch.is_prefill,
        device=device,
        ctx=contexts.setdefault(name, {}),
        requests=batch.requests,
        lengths=batch.lengths,
        padding_side=batch.padding_side,
    )


def call_hooks(
    functions: tuple[HookFunction, ...], value: Tensor, hook: Hook
) -> tuple[Tensor, bool]:
    """Run ``functions`` in order on ``value`` (a :func:`hook_copy`), each on what the one before
    left; the final value, and whether any function replaced or edited it in place."""
    version, replaced = value._version, False
    for function in functions:
        returned = _call(function, value, hook)
        if returned is not None:
            _check(returned, value, hook.name, function)
            value, replaced = returned, True
    return value, replaced or value._version != version


def _call(function: HookFunction, value: Tensor, hook: Hook) -> Tensor | None:
    try:
        return function(value, hook)
    except HookError:  # raised by vlens's own functions (split inputs), naming the user's
        raise
    except Exception as error:
        name = function_name(function)
        raise HookError(f"hook function {name} on {hook.name} raised {error!r}") from error


def _check(returned: Any, value: Tensor, name: str, function: HookFunction) -> None:
    label = f"hook function {function_name(function)} on {name}"
    if not isinstance(returned, Tensor):
        raise HookError(f"{label} returned {type(returned).__name__}; return a tensor or None")
    if returned.shape != value.shape:
        raise HookError(
            f"{label} returned shape {tuple(returned.shape)}; expected {tuple(value.shape)}"
        )
    if returned.dtype != value.dtype:
        raise HookError(f"{label} returned dtype {returned.dtype}; expected {value.dtype}")


def function_name(function: Any) -> str:
    """A hook function's name for messages: a ``functools.partial`` by the function it wraps
    (its repr would print the bound arguments, often whole tensors)."""
    wrapped = getattr(function, "func", function)
    return getattr(wrapped, "__qualname__", type(wrapped).__name__)
