"""Running a user's TransformerLens hook function on the rows of one request, or of a call's
batch, and writing its edit back.

The function sees TransformerLens's value as a tensor of its own: ``[batch, pos, ...]`` for the
requests of one call that run together (:mod:`vlens.runtime.hooks.batches`), in their order in the call,
or ``[1, pos, ...]`` for one request (``pos`` = the rows in this engine step: the prompt, a prefill
chunk, or one decode row). It may return a replacement, or edit the tensor in place and return
None: either way the edit is written into vLLM's tensors through the name's write rule, so the
model computes on with it and every later name sees it. A batch is read once and written once
(one span of the step's rows, or its rows gathered), so a hook function costs about the same for
one prompt as for hundreds.
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

from vlens.runtime.hooks.batches import StepBatch
from vlens.runtime.sites.torch_hooks import NarrowedCall
from vlens.runtime.transfer.messages import HookError, HookFunction, NamePlan
from vlens.runtime.vocabulary.readers import writable


@dataclass
class Hook:
    """The ``hook`` argument of a hook function: TransformerLens's ``HookPoint`` surface
    (``name``, ``layer()``, ``ctx``) plus where these rows sit.

    ``requests`` are the indices in the call of the prompts whose rows the value holds, in
    its batch order; ``request`` the index when the value is one prompt's, None when it is a
    batch of several. ``is_prefill`` False on decode steps. Each prompt's ``length`` rows start at
    its entry of ``first_positions`` (in batch order): the same for every prompt of a batch on
    a prefill, different where prompts of different lengths decode together. :attr:`positions`
    holds every row's sequence position, ``[batch, pos]``, on the value's ``device``.
    """

    name: str
    request: int | None
    first_positions: tuple[int, ...]
    length: int
    is_prefill: bool
    device: torch.device
    ctx: dict[str, Any] = field(default_factory=dict)
    requests: tuple[int, ...] = ()

    @property
    def first_position(self) -> int:
        """The position of the first row, where every prompt of the value starts there."""
        if len(set(self.first_positions)) > 1:
            raise ValueError(
                f"the prompts of this batch are at different positions {self.first_positions} "
                f"(prompts of different lengths decoding together): use hook.first_positions "
                f"(one per prompt, in batch order) or hook.positions ([batch, pos])"
            )
        return self.first_positions[0]

    @cached_property
    def positions(self) -> Tensor:
        """``[batch, pos]``: each row's sequence position, beside the value's ``[batch, pos]``
        axes, so that ``x[hook.positions >= 5] += v`` edits those rows whether the prompts sit at
        the same positions or not. Made when first asked for (most hooks never do), where the
        value is."""
        offsets = torch.arange(self.length, device=self.device)
        return torch.tensor(self.first_positions, device=self.device)[:, None] + offsets

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
    batch: StepBatch,
    whole: NarrowedCall,
    contexts: dict[str, dict[str, Any]],
) -> None:
    """Run ``plan.hooks`` in order on the value of ``plan.name`` of the requests of ``batch``
    (``whole``, the site's call over the whole step, narrowed to their rows), batched in their
    order, and write each one's part of the edit back. The batch is read once and written once
    (:func:`batch_call`), whatever its size."""
    call = batch_call(whole, batch)
    original = plan.read(call)
    batched = original.unflatten(0, (len(batch.rows), batch.length))
    value = arranged(plan, hook_copy(batched))
    hook = hook_point(plan.name, batch, value.device, contexts)
    value, edited = call_hooks(plan.hooks, value, hook)
    if not edited:
        return
    if not writable(plan.read):
        raise HookError(
            f"a hook on {plan.name} changed its value, but {plan.name} cannot be written back "
            f"into vLLM (it is computed from the model's tensors, not one of them): hook a name "
            f"that feeds it instead"
        )
    new = rows_from_hook(plan, value).flatten(0, 1)
    plan.read.write(call, new.to(original.dtype))


Refusal = Callable[[str, Sequence[HookFunction], StepBatch], None]


def run_hooks_together(
    plan: NamePlan,
    batches: Sequence[StepBatch],
    whole: NarrowedCall,
    contexts: dict[str, dict[str, Any]],
    refuse: Refusal | None = None,
) -> dict[int, HookError]:
    """:func:`run_hooks` for several batches of one step with the same hook functions at
    ``plan.name``: the value of all their rows is read once, copied once and, if some function
    edited it, written back once; each batch's functions run on a view of its own rows, as they
    would alone. (A call's prompts that prefill in different steps, or finish at different
    times, each run alone: without this, every one of them would cost a read, a copy and a
    write.) Each batch is first passed to ``refuse``. Returns the failures by ``id`` of the
    batch; a failed batch's rows are written back as they were."""
    if plan.arrange is not None or not writable(plan.read):
        return _one_by_one(plan, batches, whole, contexts, refuse)
    members = [member for batch in batches for member in batch.members]
    call = batch_call(whole, StepBatch.of(members))
    original = plan.read(call)
    value = hook_copy(original)
    version = value._version
    failures: dict[int, HookError] = {}
    start = 0
    for batch in batches:
        rows = slice(start, start + len(batch.rows) * batch.length)
        start = rows.stop
        part = value[rows].unflatten(0, (len(batch.rows), batch.length))
        try:
            if refuse is not None:
                refuse(plan.name, plan.hooks, batch)
            hook = hook_point(plan.name, batch, value.device, contexts)
            result, _ = call_hooks(plan.hooks, part, hook)
            if result is not part:
                part.copy_(result)
        except HookError as error:
            failures[id(batch)] = error
            part.copy_(original[rows].unflatten(0, part.shape[:2]))
    if value._version != version:
        plan.read.write(call, value)
    return failures


def _one_by_one(
    plan: NamePlan,
    batches: Sequence[StepBatch],
    whole: NarrowedCall,
    contexts: dict[str, dict[str, Any]],
    refuse: Refusal | None,
) -> dict[int, HookError]:
    """:func:`run_hooks_together` where the value cannot be viewed per batch (a name
    TransformerLens arranges otherwise) or written back (then only the batch that edits fails)."""
    failures: dict[int, HookError] = {}
    for batch in batches:
        try:
            if refuse is not None:
                refuse(plan.name, plan.hooks, batch)
            run_hooks(plan, batch, whole, contexts)
        except HookError as error:
            failures[id(batch)] = error
    return failures


def refuse_part_of_a_prefill(
    name: str, functions: Sequence[HookFunction], batch: StepBatch
) -> None:
    """A hook function shared by a call's prompts is TransformerLens's: it sees each prompt's
    whole prefill at once, and may index it at absolute positions. Where vLLM split a prefill
    over engine steps (an engine built with a ``max_num_batched_tokens`` below the prompt's
    length), running it on a step's part would edit the wrong rows: refused instead."""
    if not batch.prefills:
        return
    for own, index in zip(batch.rows, batch.indices):
        rows_run = own.stop - own.start
        if own.is_prefill and (own.first_position > 0 or rows_run < own.prompt_length):
            raise HookError(
                f"hook function {function_name(functions[0])} on {name}: vLLM split prompt "
                f"{index}'s prefill ({own.prompt_length} tokens) over engine steps, so this step "
                f"holds only its positions {own.first_position}-{own.first_position + rows_run - 1}"
                f", where TransformerLens hands a hook the whole prompt. Build the model without "
                f"max_num_batched_tokens (vlens then prefills every prompt in one step) or with "
                f"max_num_batched_tokens >= {own.prompt_length}; or pass the function in "
                f"prompt_hooks, whose functions see each step's rows (hook.positions)"
            )


def batch_call(whole: NarrowedCall, batch: StepBatch) -> NarrowedCall:
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


def hook_batch(values: Sequence[Tensor]) -> Tensor:
    """Tensors of one shape (one per request) stacked on a new first axis, as the hook
    function's own tensor (see :func:`hook_copy`)."""
    if len(values) == 1:
        return hook_copy(values[0].unsqueeze(0))
    with torch.inference_mode(False):
        return torch.stack(list(values))


def hook_point(
    name: str, batch: StepBatch, device: torch.device, contexts: dict[str, dict[str, Any]]
) -> Hook:
    """The ``hook`` argument for the requests of ``batch`` at ``name``."""
    return Hook(
        name=name,
        request=batch.indices[0] if len(batch.indices) == 1 else None,
        first_positions=batch.first_positions,
        length=batch.length,
        is_prefill=batch.rows[0].is_prefill,
        device=device,
        ctx=contexts.setdefault(name, {}),
        requests=batch.indices,
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
