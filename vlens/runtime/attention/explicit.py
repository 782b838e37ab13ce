"""Attention computed explicitly in the worker, so that hook functions on a layer's scores, pattern
and per-head results see and edit the real values (TransformerLens's ``hook_attn_scores``,
``hook_pattern``, ``hook_result``, which vLLM's kernels never form).

Only for the requests whose plans carry such hooks (an :class:`AttentionPlan` per layer) and only
at those layers; every other request in the step, and every other layer, stays on vLLM's kernels.
Two forward hooks, each registered ahead of any other hook on its module:

- on the layer's attention module (:attr:`ExplicitAttention.kernel`, called with the rotated q, k
  and v), for each such request's rows:

  1. its keys and values of this step join its own history of that layer, kept from its first
     step on (:class:`~vlens.runtime.attention.kv_history.KeyValueHistory`; vLLM's paged cache is not read);
  2. scores ``q·kᵀ·scale`` over every key so far, causally masked to -inf, go through the
     ``hook_attn_scores`` functions as ``[1, head, q_pos, k_pos]``;
  3. their softmax goes through the ``hook_pattern`` functions, the same shape;
  4. where a function changed either, ``z = pattern·v`` replaces the request's rows of the
     module's output (what ``hook_z`` and ``W_O`` see next); where none did, vLLM's own z stays,
     bit for bit.

- on the output projection (:attr:`ExplicitAttention.projection`): each head's result
  ``z_h·W_O[h]`` (``W_O`` read off the module once per layer, :func:`projection_weights`) goes
  through the ``hook_result`` functions as ``[1, pos, head, d_model]``; where they change it,
  ``Σ_h result_h + b_O`` replaces the request's rows of the projection's output.

The hook functions a call's prompts share run each stage once per step on the call's padded batch
(``[batch, head, q_pos, k_pos]``, ``[batch, pos, head, d_model]``, each prompt's queries and keys
at the start or the end of their axes as the call pads: :mod:`vlens.runtime.hooks.batches`; scores
padded with -inf, patterns and results with zeros), then each prompt's own functions on its value
alone; an edit of the batch rewrites every prompt of it.

The stages a plan keeps are recorded as the hooks leave them and handed back as whole values
(``RequestCapture.formed``), for the cache to hold instead of what it would rebuild from q and k.
Needs one rank holding whole modules: tensor parallelism is refused (:func:`unsupported`). On a
compiled engine the two hooks are the graph's ``call`` sites of the declared layers
(:mod:`vlens.runtime.compiled.hook_sites`), which call them with the module call's tensors.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import torch
from torch import Tensor, nn

from vlens.runtime.attention.arithmetic import (
    causal_scores,
    mixed_values,
    per_head_results,
    projection_weights,
    softmax_pattern,
)
from vlens.runtime.attention.kv_history import KeyValueHistory
from vlens.runtime.hooks.batches import HookBatch, call_of
from vlens.runtime.hooks.calls import call_hooks, hook_copy, hook_point, refuse_part_of_a_prefill
from vlens.runtime.sites.torch_hooks import NarrowedCall, find_module
from vlens.runtime.steps.layout import RequestRows
from vlens.runtime.transfer.messages import (
    AttentionPlan,
    HookError,
    PaddingSide,
    RequestCapture,
)

if TYPE_CHECKING:
    from vlens.runtime.vocabulary.locations import ExplicitAttention

#: What fills a stage where a request's rows have no value: keys after a query, and a padded
#: batch's padding (scores at -inf, pattern and results at 0).
_FILL = {"scores": float("-inf"), "pattern": 0.0, "result": 0.0}
#: Each stage's position axes, in one request's value without the batch axis.
_POSITION_AXES = {"scores": (1, 2), "pattern": (1, 2), "result": (0,)}


@dataclass
class LayerAttention:
    """One request's explicitly computed attention at one layer: its plan, its index in the call
    (of ``call_size`` prompts), its key/value history and the kept stages, one
    ``(first_position, value)`` per step."""

    plan: AttentionPlan
    index: int
    call_size: int = 1
    padding_side: PaddingSide = "right"
    history: KeyValueHistory = field(default_factory=KeyValueHistory)
    kept: dict[str, list[tuple[int, Tensor]]] = field(default_factory=dict)

    def formed(self, device: str) -> dict[str, Tensor]:
        """Each kept stage over every position the request ran, in TransformerLens's layout
        without the batch axis; a position run twice (preemption) keeps its later value."""
        return {
            self.plan.names[stage]: _joined(stage, steps).to(device)
            for stage, steps in self.kept.items()
        }


def _joined(stage: str, steps: list[tuple[int, Tensor]]) -> Tensor:
    """A kept stage's steps in one tensor: results ``[pos, head, d_model]``; scores and
    patterns ``[head, q_pos, k_pos]`` with keys after each step's last query filled."""
    if stage == "result":
        length = max(first + value.shape[0] for first, value in steps)
        whole = steps[0][1].new_full((length, *steps[0][1].shape[1:]), _FILL[stage])
        for first, value in steps:
            whole[first : first + value.shape[0]] = value
        return whole
    length = max(first + value.shape[1] for first, value in steps)
    whole = steps[0][1].new_full((steps[0][1].shape[0], length, length), _FILL[stage])
    for first, value in steps:
        whole[:, first : first + value.shape[1], : value.shape[2]] = value
    return whole


#: Which of a layer's modules a hook sits on: the attention kernel or the output projection.
Role = Literal["kernel", "projection"]

class Attended(NamedTuple):
    """A request served by a layer's hook this step."""

    rows: RequestRows
    state: LayerAttention  # its state at this layer
    capture: RequestCapture

#: What runs one hook's stages for a batch of requests (one request, or a call's batch).
Stage = Callable[[list[Attended], list[NarrowedCall]], None]


class AttentionSites:
    """The explicitly computed layers of the followed requests, and the hooks they need."""

    def __init__(
        self,
        model: nn.Module,
        layout: Callable[[], list[RequestRows] | None],
        captures: dict[str, RequestCapture],
        contexts: dict[str, dict[str, Any]],
        in_graph: bool = False,
    ) -> None:
        self.model = model
        self.layout = layout
        self.captures = captures
        self.contexts = contexts
        #: whether a compiled graph calls the hooks (:meth:`fired_in_graph`, from its ``call``
        #: sites), rather than torch hooks on the modules
        self.in_graph = in_graph
        #: (tag, module path, role) → the request's state at that layer, under each hook it needs
        self.layers: dict[tuple[str, str, Role], LayerAttention] = {}
        #: (module path, role) → the hook (a torch hook's handle, or in the graph the function)
        self.handles: dict[tuple[str, Role], Any] = {}
        self.weights: dict[tuple[str, torch.dtype, torch.device], tuple[Tensor, Tensor]] = {}

    def prepare(
        self,
        tag: str,
        index: int,
        call_size: int,
        plans: tuple[AttentionPlan, ...],
        padding_side: PaddingSide = "right",
    ) -> None:
        for plan in plans:
            state = LayerAttention(plan, index, call_size, padding_side)
            if plan.forms_pattern:
                self.layers[(tag, plan.attention.kernel, "kernel")] = state
            if plan.forms_results:
                self.layers[(tag, plan.attention.projection, "projection")] = state
        for key in self._needed() - self.handles.keys():
            path, role = key
            fired = self._kernel_fired(path) if role == "kernel" else self._projection_fired(path)
            if self.in_graph:
                self.handles[key] = fired
            else:
                module = find_module(self.model, path)
                self.handles[key] = module.register_forward_hook(fired, with_kwargs=True,
                                                                 prepend=True)

    def paths(self) -> set[str]:
        """The modules where some request needs attention computed."""
        return {path for path, _ in self.handles}

    def fired_in_graph(self, path: str, args: tuple, kwargs: dict, output: Any) -> None:
        """A compiled graph's ``call`` site at ``path`` ran: the hook of that module."""
        for role in ("kernel", "projection"):
            fired = self.handles.get((path, role))
            if fired is not None:
                fired(None, args, kwargs, output)

    def finish(self, tags: list[str], device: str) -> dict[str, dict[str, Tensor]]:
        """What these requests kept, by tag and name; their state is dropped, and the hooks that
        no request needs any more."""
        wanted = set(tags)
        mine = [key for key in self.layers if key[0] in wanted]
        formed: dict[str, dict[str, Tensor]] = {}
        try:
            states = {id(self.layers[key]): (key[0], self.layers[key]) for key in mine}
            for tag, state in states.values():  # a state may sit under both hooks
                formed.setdefault(tag, {}).update(state.formed(device))
        finally:
            for key in mine:
                del self.layers[key]
            needed = self._needed()
            for key in list(self.handles):
                if key not in needed:
                    handle = self.handles.pop(key)
                    if not self.in_graph:
                        handle.remove()
        return formed

    def _needed(self) -> set[tuple[str, Role]]:
        return {(path, role) for _, path, role in self.layers}

    # ---- in the forward ----------------------------------------------------------------------

    def _served(self, path: str, role: Role) -> list[Attended]:
        """This step's rows of the requests with a state under this hook, still without error."""
        served = []
        for rows in self.layout() or ():
            state = self.layers.get((rows.tag, path, role))
            capture = self.captures.get(rows.tag)
            if state is not None and capture is not None and capture.error is None:
                served.append(Attended(rows, state, capture))
        return served

    def _batches(self, path: str, role: Role) -> list[list[Attended]]:
        """The served requests by call, each call's in its order: they run this hook's stages
        together (the functions their prompts share once on the call's batch)."""
        by_call: dict[str, list[Attended]] = {}
        for member in self._served(path, role):
            by_call.setdefault(call_of(member.rows.tag), []).append(member)
        return [sorted(members, key=lambda member: member.state.index)
                for members in by_call.values()]

    def _fired(self, path: str, role: Role, run: Stage):
        def hook(_module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            for batch in self._batches(path, role):
                calls = [NarrowedCall(self.model, rows, args, kwargs, output) for rows, *_ in batch]
                _guarded(batch, run, calls)

        return hook

    def _kernel_fired(self, path: str):
        return self._fired(path, "kernel", self._attend)

    def _projection_fired(self, path: str):
        return self._fired(path, "projection", self._project)

    @torch.no_grad()
    def _attend(self, batch: list[Attended], calls: list[NarrowedCall]) -> None:
        attention = batch[0].state.plan.attention
        scores, histories = [], []
        for (rows, state, _), call in zip(batch, calls):
            n = rows.stop - rows.start
            q = call.argument(attention.query.index, attention.query.name)
            k = call.argument(attention.key.index, attention.key.name)
            v = call.argument(attention.value.index, attention.value.name)
            keys, values = state.history.extend(
                rows.first_position,
                k.reshape(n, attention.kv_heads, attention.d_head),
                v.reshape(n, attention.kv_heads, attention.value_width),
            )
            q = q.reshape(n, attention.heads, attention.d_head)
            scores.append(
                causal_scores(
                    q, keys, attention.scale, rows.first_position, alibi=attention.alibi
                ).to(q.dtype)
            )
            histories.append(values)
        scores, edited_scores = self._stage(batch, "scores", scores)
        patterns = [softmax_pattern(value).to(value.dtype) for value in scores]
        patterns, edited_pattern = self._stage(batch, "pattern", patterns)
        if not (edited_scores or edited_pattern):
            return
        for call, pattern, values in zip(calls, patterns, histories):
            z = mixed_values(pattern, values).reshape(pattern.shape[1], -1)
            out = call.output(None)
            call.assign_output(None, z.to(out.dtype))

    @torch.no_grad()
    def _project(self, batch: list[Attended], calls: list[NarrowedCall]) -> None:
        attention = batch[0].state.plan.attention
        results, biases = [], []
        for (rows, _, _), call in zip(batch, calls):
            z = call.argument(attention.projection_input.index, attention.projection_input.name)
            weight, bias = self._projection_weights(attention, z)
            z = z.reshape(rows.stop - rows.start, attention.heads, attention.value_width)
            results.append(per_head_results(z, weight).to(z.dtype))
            biases.append(bias)
        results, edited = self._stage(batch, "result", results)
        if not edited:
            return
        for call, result, bias in zip(calls, results, biases):
            out = call.output(attention.projection_element)
            total = result.float().sum(dim=1) + bias.float()
            call.assign_output(attention.projection_element, total.to(out.dtype))

    def _projection_weights(self, attention: ExplicitAttention, z: Tensor) -> tuple[Tensor, Tensor]:
        """``W_O`` and ``b_O`` of a layer, read once per dtype and device for the engine's life
        (the weights never change)."""
        key = (attention.projection, z.dtype, z.device)
        if key not in self.weights:
            module = find_module(self.model, attention.projection)
            width = attention.heads * attention.value_width
            self.weights[key] = projection_weights(module, width, attention.projection_element, z)
        return self.weights[key]

    def _stage(
        self, batch: list[Attended], stage: str, values: list[Tensor]
    ) -> tuple[list[Tensor], bool]:
        """Each request's ``value`` (without the batch axis) through the stage's hook functions:
        those the call's prompts share once on their padded batch, then each request's own; kept
        where its plan keeps the stage. Whether a function changed them."""
        first = batch[0].state
        name = first.plan.names.get(stage, "")
        edited = False
        shared = first.plan.batch_hooks.get(stage, ())
        if shared:
            layout = HookBatch([member.rows for member in batch],
                               tuple(member.state.index for member in batch), first.call_size,
                               tuple(range(first.call_size)), first.padding_side)
            refuse_part_of_a_prefill(name, shared, layout)
            axes = _POSITION_AXES[stage]
            padded = layout.padded_values(values, axes, _FILL[stage])
            hook = hook_point(name, layout, padded.device, self.contexts)
            padded, edited = call_hooks(shared, padded, hook)
            if edited:
                values = layout.unpadded_values(padded, values, axes)
        for position, (rows, state, _) in enumerate(batch):
            own = state.plan.hooks.get(stage, ())
            if own:
                alone = HookBatch([rows], (0,), 1, (state.index,))
                value = hook_copy(values[position][None])
                hook = hook_point(name, alone, value.device, self.contexts)
                value, changed = call_hooks(own, value, hook)
                values[position], edited = value[0], edited or changed
        for (rows, state, _), value in zip(batch, values):
            if stage in state.plan.keep:  # the hooks' own tensor, or one computed here: no copy
                state.kept.setdefault(stage, []).append((rows.first_position, value))
        return values, edited


def _guarded(batch: list[Attended], run: Stage, calls: list[NarrowedCall]) -> None:
    """``run(batch, calls)``; a failure is recorded for every request of the batch (raised to the
    caller after the call) and stops their hooks."""
    try:
        run(batch, calls)
    except HookError as error:
        for member in batch:
            member.capture.fail(str(error), error.__cause__)
    except Exception:
        names = ", ".join(batch[0].state.plan.names.values())
        message = f"while computing attention for {names}:\n{traceback.format_exc()}"
        for member in batch:
            member.capture.fail(message)


def unsupported(tensor_parallel: bool) -> str | None:
    """Why attention cannot be computed explicitly on this worker, if it cannot: it needs whole
    modules on one rank. (The user's side refuses such hooks when they are added; this is the
    worker's own guard, reported as the request's error, since a worker that raised here would
    leave vLLM's other ranks' answers unread.)"""
    if tensor_parallel:
        return (
            "hooks on attention scores, patterns and per-head results are not yet available "
            "under tensor parallelism: vlens computes those layers' attention in the worker from "
            "whole q, k, v and W_O, and each rank holds only its own heads; use "
            "tensor_parallel_size=1, or hook hook_rot_q / hook_rot_k / hook_v / hook_z"
        )
    return None
