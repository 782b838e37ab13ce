"""What vlens changes in vLLM's forward, done again on the gradient twin: SAEs spliced in with
``add_sae`` and :class:`~vlens.runtime.vocabulary.steering.Steer` values, with the engine's
meaning.

An SAE at ``name`` becomes a forward hook there, run before any other, whose value is the SAE's
output (what the engine's splice writes back, :mod:`vlens.runtime.sites.splices`). The SAE's own
hook points (``{name}.hook_sae_input`` ... ``.hook_sae_output``) are TransformerLens
``HookPoint`` modules entered in the twin's registry of hook names: forward hooks, backward hooks
(``{name}.hook_sae_acts_post``: the gradient of the features, as SAELens's
``HookedSAETransformer`` gives it) and the twin's caches reach them as any other name.

A steer becomes a forward hook after the model's own at its name, as on the eager engine; its
positions count from each prompt's first token, wherever the padding puts that token. A
per-prompt hook function (``prompt_hooks``) sees its prompt's own rows, ``[1, pos_i, ...]``
without padding, as on the engine, and what it returns (or edits in place) lands there.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from transformer_lens.hook_points import HookPoint

from vlens.hooked import twin_models
from vlens.runtime.vocabulary.steering import AnySteer, SAESteer, Steer, steered
from vlens.sae.autoencoder import SAE

TwinHook = Callable[[Tensor, Any], Tensor | None]


class TwinSplice:
    """One SAE spliced into the twin at ``name``: its hook points registered there while it is
    attached (:meth:`register` / :meth:`unregister`), and the hook that runs it."""

    def __init__(self, sae: SAE, name: str, stages: Sequence[str], use_error_term: bool) -> None:
        self.sae = sae
        self.name = name
        self.use_error_term = use_error_term
        self.points = {stage: HookPoint() for stage in stages}
        for stage, point in self.points.items():
            point.name = f"{name}.{stage}"
        self._copies: dict[torch.device, SAE] = {}

    def register(self, twin: Any) -> None:
        for point in self.points.values():
            twin_models.register_point(twin, point)

    def unregister(self, twin: Any) -> None:
        for point in self.points.values():
            point.remove_hooks(dir="both", including_permanent=True)
            twin_models.unregister_point(twin, point.name)

    def hook(self, value: Tensor, hook: Any) -> Tensor:
        """The SAE's output for ``value``, through its hook points, in ``value``'s dtype."""
        return self._sae_on(value.device).run(value, self._visit, self.use_error_term).to(
            value.dtype)

    def _visit(self, stage: str, value: Tensor) -> Tensor:
        if stage == "hook_sae_input":  # an edit here must not reach the error term's input
            value = value.clone()
        return self.points[stage](value)

    def _sae_on(self, device: torch.device) -> SAE:
        """The SAE where the twin runs (a copy where the user's is elsewhere)."""
        if self.sae.device == device:
            return self.sae
        if device not in self._copies:
            self._copies[device] = copy.deepcopy(self.sae).to(device)
        return self._copies[device]


def steering_hooks(
    steers: Sequence[tuple[AnySteer, ...]], starts: Sequence[int], lengths: Sequence[int]
) -> list[tuple[str, TwinHook]]:
    """Each name's steers (``steers[i]``: prompt ``i``'s, by canonical name) as one forward hook
    on the twin's padded batch; prompt ``i``'s tokens are at ``starts[i]:starts[i] +
    lengths[i]``."""
    by_name: dict[str, dict[int, Steer]] = {}
    for index, own in enumerate(steers):
        for steer in own:
            if isinstance(steer, SAESteer):
                raise NotImplementedError(
                    f"SAESteer({steer.sae!r}) on the gradient twin: it edits an SAE compiled into "
                    f"the engine's graph (compiled_saes), which the twin does not hold; splice "
                    f"the SAE in with add_sae and edit its features with a hook on "
                    f"hook_sae_acts_post"
                )
            by_name.setdefault(steer.name, {})[index] = steer
    return [(name, _steering_hook(per_prompt, starts, lengths))
            for name, per_prompt in by_name.items()]


def _steering_hook(
    per_prompt: dict[int, Steer], starts: Sequence[int], lengths: Sequence[int]
) -> TwinHook:
    def apply_steers(value: Tensor, hook: Any) -> Tensor:
        rows = value.reshape(*value.shape[:2], -1)  # [batch, pos, width]
        out = rows.clone()
        for index, steer in per_prompt.items():
            terms = [t.to(value.device, value.dtype) for t in steer.terms(rows.shape[-1])]
            chosen = [starts[index] + offset for offset in steer.offsets(0, lengths[index])]
            out[index, chosen] = steered(rows[index, chosen], *terms)
        return out.reshape(value.shape)

    return apply_steers


def prompt_hook(
    function: TwinHook, index: int, start: int, length: int, position_axes: Sequence[int]
) -> TwinHook:
    """``function``, a hook of prompt ``index`` only, on the twin's padded batch: it is handed
    that prompt's row with its real positions (``start:start + length`` along each of
    ``position_axes``, the batch axis being 0) and its result written back there."""

    def on_own_rows(value: Tensor, hook: Any) -> Tensor | None:
        rows = tuple(
            slice(index, index + 1) if axis == 0
            else slice(start, start + length) if axis in position_axes else slice(None)
            for axis in range(value.ndim)
        )
        own = value[rows]  # a view: an edit in place lands in the batch
        result = function(own, hook)
        if result is None:
            return None
        out = value.clone()
        out[rows] = result
        return out

    return on_own_rows
