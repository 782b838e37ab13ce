"""Attribution patching: the linear estimate of activation patching from one gradient pass.

As TransformerLens's ``Attribution_Patching_Demo`` computes it: patching the clean activation
``a_clean`` into the corrupted run changes the metric by about
``(a_clean - a_corrupted) · d metric / d a`` (the gradient at the corrupted run), summed over
the batch and the activation's feature dimension, and over whichever of position and head the
result does not keep. Every layer's cell of every name costs one forward and one backward in
all, where activation patching runs a forward per cell.

The clean cache is the user's (a vLLM ``run_with_cache``). The corrupted activations and their
gradients come from one forward and backward on the gradient twin
(:mod:`vlens.hooked.gradients`), so both are taken at the same point of the same model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor
from transformer_lens.patching import AxisNames

from vlens.names.tl_versions import get_act_name
from vlens.patching.sweep import as_tokens

#: The activations attribution patching reads, by TransformerLens's short name: the axes of
#: their cache entries (``d``: the feature axis, always summed).
AXES: dict[str, tuple[str, ...]] = {
    **{name: ("batch", "pos", "d")
       for name in ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")},
    **{name: ("batch", "pos", "head", "d") for name in ("z", "q", "k", "v")},
}


def attribution(
    model: Any,
    corrupted_tokens: Int[Tensor, "batch pos"],
    clean_cache: Any,
    patching_metric: Callable[[Tensor], Tensor],
    activation_name: str | Sequence[str] = "resid_pre",
    index_axis_names: Sequence[AxisNames] | None = None,
) -> Tensor:
    """Attribution patching of ``activation_name`` at every layer: ``(clean - corrupted) ·
    grad``, the gradient of ``patching_metric`` (logits ``[batch, pos, d_vocab]`` -> a scalar)
    at the corrupted run, summed over the batch, the feature axis and the axes not kept.

    ``index_axis_names``: the result's axes, as the activation patching functions lay them
    out: ``("layer", "pos")`` (the default for the residual stream, ``attn_out``, ``mlp_out``:
    ``get_act_patch_resid_pre``'s shape), ``("layer", "pos", "head")`` (the default for ``z``,
    ``q``, ``k``, ``v``: ``get_act_patch_attn_head_out_by_pos``'s), ``("layer", "head")``
    (``..._all_pos``'s) or ``("layer",)``. Several names (of results of one shape) give their
    results stacked on a first axis, from the same single gradient pass.
    """
    names = [activation_name] if isinstance(activation_name, str) else list(activation_name)
    unknown = [name for name in names if name not in AXES]
    if unknown or not names:
        raise ValueError(f"attribution patching reads {sorted(AXES)}, got {unknown or names}")
    layers = range(model.cfg.n_layers)
    hook_names = [get_act_name(name, layer) for name in names for layer in layers]
    corrupted, grads = corrupted_with_gradients(model, as_tokens(model, corrupted_tokens),
                                                patching_metric, hook_names)
    results = []
    for name in names:
        keep = kept_axes(name, index_axis_names)
        per_layer = []
        for layer in layers:
            hook_name = get_act_name(name, layer)
            grad = grads[hook_name]
            clean = clean_activation(clean_cache, hook_name, corrupted[hook_name])
            product = (clean - corrupted[hook_name]) * grad
            summed = [i for i, axis in enumerate(AXES[name]) if axis not in keep]
            per_layer.append(product.sum(dim=summed))
        results.append(torch.stack(per_layer))
    if len(results) == 1:
        return results[0]
    shapes = {tuple(result.shape) for result in results}
    if len(shapes) > 1:
        raise ValueError(
            f"the results of {names} have different shapes {sorted(shapes)} (grouped keys and "
            f"values have fewer heads): ask for them one call each"
        )
    return torch.stack(results)


def kept_axes(name: str, index_axis_names: Sequence[AxisNames] | None) -> tuple[str, ...]:
    """The axes of ``name``'s activation the result keeps besides the layer, in cache order."""
    if index_axis_names is None:
        return ("pos", "head") if "head" in AXES[name] else ("pos",)
    axes = tuple("head" if axis == "head_index" else axis for axis in index_axis_names)
    allowed = [axis for axis in AXES[name] if axis not in ("batch", "d")]
    if axes[:1] != ("layer",) or list(axes[1:]) != [axis for axis in allowed if axis in axes]:
        raise ValueError(
            f"index_axis_names for {name!r}: 'layer' then any of {allowed} in that order, got "
            f"{tuple(index_axis_names)}"
        )
    return axes[1:]


def corrupted_with_gradients(
    model: Any, tokens: Tensor, metric: Callable[[Tensor], Tensor], hook_names: Sequence[str]
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The activations at ``hook_names`` of the run on ``tokens``, and the gradients of
    ``metric`` of its logits there: one forward and one backward on the gradient twin, the
    model's forward hooks active."""
    activations: dict[str, Tensor] = {}
    grads: dict[str, Tensor] = {}

    def keeper(into: dict[str, Tensor], name: str) -> Callable[[Tensor, Any], None]:
        def keep(tensor: Tensor, hook: Any) -> None:  # keyed by our name: the bridge's may differ
            into[name] = tensor.detach().clone()

        return keep

    with model.on_twin("attribution patching", {}) as twin, torch.enable_grad():
        forward = [(name, keeper(activations, name)) for name in hook_names]
        backward = [(name, keeper(grads, name)) for name in hook_names]
        with twin.hooks(fwd_hooks=forward, bwd_hooks=backward):
            value = metric(twin(tokens.to(twin.cfg.device)))
            if not isinstance(value, Tensor) or value.numel() != 1:
                raise ValueError(
                    "attribution patching takes the gradient of the metric: it must return one "
                    f"number as a tensor, got {type(value).__name__}"
                    + (f" of shape {tuple(value.shape)}" if isinstance(value, Tensor) else "")
                )
            value.reshape(()).backward()
    # a backward hook the metric's graph does not reach never runs: its gradient is zero
    return activations, {name: grads.get(name, torch.zeros_like(activations[name]))
                         for name in hook_names}


def clean_activation(clean_cache: Any, hook_name: str, corrupted: Tensor) -> Tensor:
    """The clean cache's activation at ``hook_name``, where the corrupted one is."""
    try:
        clean = clean_cache[hook_name]
    except KeyError:
        raise KeyError(
            f"the clean cache has no {hook_name!r}: cache it (run_with_cache's names_filter)"
        ) from None
    if clean.shape != corrupted.shape:
        raise ValueError(
            f"{hook_name}: the clean activation is {tuple(clean.shape)}, the corrupted "
            f"{tuple(corrupted.shape)}: clean and corrupted prompts must have the same shape"
        )
    return clean.to(device=corrupted.device, dtype=corrupted.dtype)
