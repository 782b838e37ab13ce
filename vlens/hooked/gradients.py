"""Gradients in the same notebook: the calls that need autograd run on a twin of the checkpoint.

vLLM computes no gradients. A call that needs them runs instead on TransformerLens's own model
of the same checkpoint (``TransformerBridge`` over HuggingFace, or ``HookedTransformer`` under
TransformerLens 3; no weight processing: :mod:`vlens.hooked.twin_models`), whose hook names are
vlens's. What needs autograd, and so runs on the twin:

- a forward (``model(...)``, ``run_with_hooks``, ``run_with_cache``) while backward hooks are
  registered (``add_hook(name, fn, dir="bwd")``, ``hooks(bwd_hooks=...)``,
  ``run_with_hooks(..., bwd_hooks=...)``), so that the user's ``.backward()`` reaches them;
- ``run_with_cache(..., incl_bwd=True)``, which runs the backward itself, as TransformerLens does.

Everything else stays on vLLM. The forward hooks added on the model (and a call's own) run on
the twin too, with TransformerLens's ``hook`` argument, and so do the SAEs added with ``add_sae``
and a call's ``Steer`` values (:mod:`vlens.hooked.twin_edits`). The twin is built on first need (once),
on the engine's device unless :meth:`Gradients.gradient_twin` is given another, after a check
that its weights fit there; :meth:`Gradients.free_gradient_twin` lets it go.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import psutil
import torch
from torch import Tensor

from vlens.engine.checkpoint import Checkpoint
from vlens.hooked import twin_models
from vlens.hooked.hook_registry import FwdHooks, HookRegistry
from vlens.hooked.twin_edits import TwinHook, TwinSplice, prompt_hook, steering_hooks
from vlens.names.mapping import per_sample
from vlens.names.resolve import is_pattern
from vlens.names.rules import NameOrFilter
from vlens.runtime.transfer.messages import HookFunction
from vlens.runtime.vocabulary.steering import AnySteer

logger = logging.getLogger("vlens")

#: The share of the free memory of a device the twin's weights may take (its activations and
#: gradients need the rest).
WEIGHTS_SHARE = 0.5


@dataclass(frozen=True)
class BackwardHook:
    name: str
    function: HookFunction
    permanent: bool
    by_filter: bool  # added by a pattern or filter, not by its name

    @property
    def on_twin(self) -> HookFunction:
        return named(self.function, self.name)


class NamedHookPoint:
    """A twin's hook point as a hook function added at ``name`` sees it: named as vlens names it
    (the bridge's own point of an alias has the bridge's name, ``blocks.0.hook_in`` for
    ``blocks.0.hook_resid_pre``), everything else the point's."""

    def __init__(self, point: Any, name: str) -> None:
        self._point = point
        self.name = name

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._point, attribute)

    def layer(self) -> int:
        return int(self.name.split(".")[1])


def named(function: HookFunction, name: str) -> HookFunction:
    """``function`` for the twin: its ``hook`` argument named ``name``."""

    def on_twin(tensor: Any, hook: Any) -> Any:
        return function(tensor, hook=NamedHookPoint(hook, name))

    on_twin.__qualname__ = getattr(function, "__qualname__", "hook")
    return on_twin


class Gradients:
    """Mixed into :class:`vlens.HookedVLLM`: the twin, and the backward hooks it carries."""

    checkpoint: Checkpoint
    engine: Any
    registry: HookRegistry
    engine_device_type: Callable[[], str]
    _saes: Callable[[], dict]
    token_lists: Callable[..., list[list[int]]]
    _padding_side: Callable[[Literal["left", "right"] | None], str]

    _twin: Any = None
    _backward: tuple[BackwardHook, ...] = ()
    _splices: dict[str, TwinSplice]  # the SAEs spliced into the twin, by the name each replaces
    _switches: tuple[tuple[str, bool], ...] = ()  # the model's set_use_* calls, for the twin

    def gradient_twin(self, device: str | torch.device | None = None) -> Any:
        """The twin that computes gradients (TransformerLens's model of this checkpoint:
        :mod:`~vlens.hooked.twin_models`), built on first call on ``device`` (None: the
        engine's), after a check that its weights fit there. Another ``device`` later moves it."""
        if self._twin is not None:
            if device is not None and torch.device(device) != self._twin.cfg.device:
                self._twin.to(device)
            return self._twin
        where = torch.device(device if device is not None else self.engine_device_type())
        dtype = self.engine.llm.model_config.dtype
        need = check_fits(self.checkpoint.weights.parameter_count() * dtype.itemsize, where)
        twin = twin_models.build(self.checkpoint.path, where, dtype)
        logger.info("vlens: the gradient twin is built on %s (%.2f GiB of weights)", where,
                    need / 2**30)
        self._splices = {}
        self._sync_saes(twin)
        for switch, value in self._switches:
            getattr(twin, f"set_{switch}")(value)
        add_backward_hooks(twin, self._backward)
        self._twin = twin
        return twin

    def twin_call(
        self,
        input: Any,
        prepend_bos: bool | None,
        padding_side: Literal["left", "right"] | None,
        prompt_hooks: Sequence[FwdHooks] | None,
        steering: Sequence[AnySteer] = (),
        prompt_steering: Sequence[Sequence[AnySteer]] | None = None,
    ) -> tuple[list[tuple[str, TwinHook]], Tensor | None]:
        """A call's edits as forward hooks of the twin, on the padded batch that ``to_tokens``
        makes of ``input``: ``prompt_hooks[i]`` handed prompt ``i``'s own rows, as on the engine,
        then the steers. And the twin's ``attention_mask`` where prompts are padded on the left
        (the bridge then masks the padding and counts positions from each prompt's first token,
        as the engine does); None for right padding, which a causal model's real tokens never
        see."""
        lengths = [len(prompt) for prompt in self.token_lists(input, prepend_bos, padding_side)]
        left = self._padding_side(padding_side) == "left"
        starts = [max(lengths) - length if left else 0 for length in lengths]
        edits = [] if prompt_hooks is None else self._prompt_hooks(prompt_hooks, starts, lengths)
        if steering or prompt_steering is not None:
            steers = self.checkpoint.planner.steering(steering, prompt_steering, len(lengths))
            edits += steering_hooks(steers, starts, lengths)
        if not any(starts):
            return edits, None
        mask = torch.arange(max(lengths)) >= torch.tensor(starts)[:, None]
        return edits, mask.long().to(self.gradient_twin().cfg.device)

    def _prompt_hooks(
        self, prompt_hooks: Sequence[FwdHooks], starts: Sequence[int], lengths: Sequence[int]
    ) -> list[tuple[str, TwinHook]]:
        if len(prompt_hooks) != len(lengths):
            raise ValueError(f"prompt_hooks has {len(prompt_hooks)} entries for {len(lengths)} prompts")
        hooks = []
        for index, own in enumerate(prompt_hooks):
            for name_or_filter, function in own:
                for name in self.registry.names(name_or_filter):
                    spec = self.checkpoint.hook_specs.get(name)  # an SAE's names: [pos, ...]
                    words = spec.shape.split() if spec is not None else ["pos"]
                    axes = [1 + axis for axis, word in enumerate(words) if word.endswith("pos")]
                    hooks.append((name, prompt_hook(named(function, name), index, starts[index],
                                                    lengths[index], axes)))
        return hooks

    def free_gradient_twin(self) -> None:
        """Let the twin go (its memory with it); the next call that needs gradients builds it
        again, with the backward hooks still registered."""
        self._twin = None
        self._splices = {}

    def switch_twin(self, switch: str, value: bool) -> None:
        """TransformerLens's ``set_{switch}(value)`` on the twin, now and when it is built: the
        engine offers those names always, but the bridge forms them (and caches their
        gradients) only when switched on. ``use_attn_in`` and ``use_split_qkv_input`` exclude
        each other, as in TransformerLens."""
        other = {"use_attn_in": "use_split_qkv_input", "use_split_qkv_input": "use_attn_in"}
        if value and switch in other and dict(self._switches).get(other[switch]):
            raise ValueError(
                f"{switch} and {other[switch]} are mutually exclusive, as in TransformerLens: "
                f"call set_{other[switch]}(False) before set_{switch}(True)"
            )
        self._switches += ((switch, value),)
        if self._twin is not None:
            getattr(self._twin, f"set_{switch}")(value)

    # ---- backward hooks ----------------------------------------------------------------------

    def add_backward_hook(self, name_or_filter: NameOrFilter, function: HookFunction,
                          permanent: bool) -> None:
        """Backward hooks for the calls to come (on the twin, when it is built), at the names
        ``name_or_filter`` stands for that have a gradient: the sampler's names, read after the
        forward, have none (refused by name, passed over by a pattern or filter)."""
        rules = self.registry.rules
        by_name = isinstance(name_or_filter, str) and not is_pattern(name_or_filter)
        names = rules.hook_names(name_or_filter)
        if by_name and any(per_sample(rules.specs[name]) for name in names):
            raise ValueError(
                f"{name_or_filter} is read after the forward (the sampler's), so nothing has a "
                f"gradient there: hook a name of the forward (e.g. the logits at "
                f"unembed.hook_out)"
            )
        hooks = tuple(BackwardHook(name, function, permanent, not by_name) for name in names
                      if not per_sample(rules.specs[name]))
        self._backward += hooks
        if self._twin is not None:
            self._sync_saes(self._twin)
            add_backward_hooks(self._twin, hooks)

    def remove_backward_hooks(self, name: str | None, including_permanent: bool) -> None:
        """The backward hooks at ``name`` (None: every name) removed, the permanent ones too
        with ``including_permanent``."""
        self._set_backward(tuple(
            hook for hook in self._backward
            if (name is not None and hook.name != name) or (hook.permanent and not including_permanent)
        ))

    @contextmanager
    def backward_hooks_kept(self) -> Iterator[None]:
        """The backward hooks as they were before the block, on leaving it."""
        before = self._backward
        try:
            yield
        finally:
            self._set_backward(before)

    def _set_backward(self, hooks: tuple[BackwardHook, ...]) -> None:
        if hooks == self._backward:
            return
        self._backward = hooks
        if self._twin is not None:
            self._twin.reset_hooks(including_permanent=True)
            self._sync_saes(self._twin)
            add_backward_hooks(self._twin, hooks)

    def needs_gradients(self, incl_bwd: bool = False) -> bool:
        return incl_bwd or bool(self._backward)

    # ---- calls on the twin -------------------------------------------------------------------

    def _sync_saes(self, twin: Any) -> None:
        """The twin's SAEs made the model's: those taken out or replaced since, taken out (their
        hook points with them), those added since, spliced in."""
        attached = self._saes()
        for name, splice in list(self._splices.items()):
            now = attached.get(name)
            if now is None or now.sae is not splice.sae or now.use_error_term != splice.use_error_term:
                splice.unregister(twin)
                del self._splices[name]
        for name, now in attached.items():
            if name not in self._splices:
                stages = [hook_name[len(name) + 1:] for hook_name in now.names]
                self._splices[name] = TwinSplice(now.sae, name, stages, now.use_error_term)
                self._splices[name].register(twin)

    @contextmanager
    def on_twin(
        self, what: str, refused: dict[str, bool], steering: Sequence[tuple[str, TwinHook]] = ()
    ) -> Iterator[Any]:
        """The twin with, for the block, the SAEs spliced in, then the model's forward hooks,
        then ``steering`` (the call's per-prompt hooks, then its steers:
        :mod:`~vlens.hooked.twin_edits`): the engine's order at a name; ``refused``: the call's
        arguments the twin cannot honour, by name, each True where given."""
        given = [name for name, present in refused.items() if present]
        if given:
            raise NotImplementedError(
                f"{what} with backward hooks runs on the gradient twin, which does not take "
                f"{', '.join(given)} yet: use forward hooks (fwd_hooks), or call without "
                f"backward hooks"
            )
        twin = self.gradient_twin()
        self._sync_saes(twin)
        forward: list[tuple[str, TwinHook]] = [
            (splice.name, splice.hook) for splice in self._splices.values()]
        forward += [(hook.name, named(hook.function, hook.name)) for hook in self.registry.added]
        forward += steering
        admit(twin, [name for name, _ in forward])
        with twin.hooks(fwd_hooks=forward, reset_hooks_end=True):
            yield twin


def add_backward_hooks(twin: Any, hooks: Sequence[BackwardHook]) -> None:
    """``hooks`` on the twin. The bridge's switches are turned on for the names hooked by name;
    a pattern or filter passes over the names they gate, as it does on the bridge (turning
    ``use_attn_in`` on takes ``ln1``'s hook points out of the bridge's backward pass)."""
    admit(twin, [hook.name for hook in hooks if not hook.by_filter])
    for hook in hooks:
        if not (hook.by_filter and twin_models.gated_reason(twin, hook.name)):
            twin.add_hook(hook.name, hook.on_twin, dir="bwd", is_permanent=hook.permanent)


def admit(twin: Any, names: Sequence[str]) -> None:
    """The twin's switches for ``names`` turned on (TransformerLens forms
    ``hook_attn_in``, the split q/k/v inputs, ``hook_mlp_in`` and per-head ``hook_result`` only
    when asked, as vlens does not need to be)."""
    wanted = {reason for name in names
              if (reason := twin_models.gated_reason(twin, name)) is not None}
    if {"use_attn_in", "use_split_qkv_input"} <= wanted | {
            flag for flag in ("use_attn_in", "use_split_qkv_input") if getattr(twin.cfg, flag, False)}:
        raise NotImplementedError(
            "the gradient twin (TransformerLens) forms hook_attn_in or the split "
            "hook_q_input / hook_k_input / hook_v_input, not both: hook one kind per call "
            "(model.free_gradient_twin() starts a twin afresh)"
        )
    for reason in sorted(wanted):
        getattr(twin, f"set_{reason}")(True)


def check_fits(weights: int, device: torch.device) -> int:
    """``weights`` (bytes), once they are known to fit on ``device`` beside what runs there."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = psutil.virtual_memory().available
    if weights > WEIGHTS_SHARE * free:
        raise MemoryError(
            f"the gradient twin needs {weights / 2**30:.2f} GiB for its weights on {device}, "
            f"where {free / 2**30:.2f} GiB are free (vLLM holds most of a GPU for its KV cache): "
            f"build it elsewhere with model.gradient_twin(device='cpu'), or load the engine with "
            f"a lower gpu_memory_utilization"
        )
    return weights
