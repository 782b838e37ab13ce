"""Activation patching as TransformerLens's ``transformer_lens.patching`` offers it, run as one
batched vLLM call.

``from vlens import patching`` in place of ``from transformer_lens import patching``: the same
functions, arguments and results (tensors, ``index_df``, :class:`PatchingResult`), on a
:class:`~vlens.HookedVLLM`. TransformerLens runs one forward per patch (every ``(layer, pos)``,
``(layer, head)``, ... cell, on the whole corrupted batch) and applies the metric to its logits;
here every cell × every corrupted prompt is one vLLM request with its own hook (``prompt_hooks``),
all submitted together, and the metric is applied afterwards to each cell's logits, those of its
``b`` prompts stacked as ``[b, pos, d_vocab]``: exactly what TransformerLens's metric receives.
vLLM runs each request as it would run alone, so a cell's logits are those of its own forward.

TransformerLens's own pieces are used as they are: its patch setters, ``make_df_from_ranges``,
:class:`PatchingResult` and the way its ``*_every`` helpers stack their sweeps.

Two extensions, keyword-only on every function:

* ``final_logits_only=True``: the metric receives the logits of the last position only,
  ``[b, 1, d_vocab]``: the ones vLLM computes anyway to sample, so the unembedding of every other
  position is skipped and the logits take ``1/pos`` of the memory. For metrics that read
  ``logits[:, -1]`` only (logit differences at the answer).
* ``max_logits_gb`` (default 1): the most logits one vLLM call hands back; a sweep whose logits
  are larger is split into several calls (whole cells each), its metric applied after each.

Hooks and split prefills. A vlens hook sees one request's rows of one engine step; where vLLM
splits a prompt's prefill over several steps (an engine built with a small
``max_num_batched_tokens``), those are only part of the prompt, while a patch setter indexes absolute positions of a whole-prompt activation. Each
hook therefore puts its rows into a copy of the clean activation (full length), calls the setter
on that, and hands back its own rows: the patch lands on the right positions whichever step
computes them.

A patch setter gets one prompt's activations, ``[1, ...]`` (TransformerLens's setters all index
``[:, ...]``: every prompt of the batch alike); any other setter gets the whole batch, as in
TransformerLens (positions of other prompts and other steps filled from the clean activation),
and this request's rows are taken back from it.

Attention-pattern patching needs hooks that edit ``attn.hook_pattern`` (vlens computes that
layer's attention in the worker for the hooked requests): an eager engine on one rank; elsewhere
the pattern sweeps raise ``NotImplementedError`` with vlens's reason. Direct path patching
(``get_act_patch_direct_path``) edits one later head's own copy of the block input
(``hook_q_input``), which vLLM never forms: vlens places that edit where it lands
(:mod:`vlens.hooked.split_inputs`).

``transformer_lens.patching`` itself on a vlens model works too: vlens prefills every prompt in
one engine step and hands its hook the call's batch, ``[batch, pos, ...]``, where the prompts run
together; one vLLM call per cell, so much slower than this module. On an engine built to split
prefills (an explicit ``max_num_batched_tokens``), its hook, shared by the call's prompts, is
refused on a split prefill (``HookError``); this module's per-prompt hooks work there too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, Literal

import pandas as pd
import torch
import transformer_lens.patching as tl
from jaxtyping import Float, Int
from torch import Tensor
from transformer_lens.patching import (
    AxisNames,
    MetricFn,
    PatchingResult,
    layer_head_dest_src_pos_pattern_patch_setter,
    layer_head_pattern_patch_setter,
    layer_head_pos_pattern_patch_setter,
    layer_head_vector_patch_setter,
    layer_pos_head_vector_patch_setter,
    layer_pos_patch_setter,
    make_df_from_ranges,
)

from vlens.names.tl_versions import get_act_name
from vlens.patching.attribution import attribution
from vlens.patching.sweep import as_tokens, make_sweep, run_sweeps

__all__ = [
    "PatchingResult",
    "generic_activation_patch",
    "make_df_from_ranges",
    "layer_pos_patch_setter",
    "layer_pos_head_vector_patch_setter",
    "layer_head_vector_patch_setter",
    "layer_head_pattern_patch_setter",
    "layer_head_pos_pattern_patch_setter",
    "layer_head_dest_src_pos_pattern_patch_setter",
    "get_act_patch_resid_pre",
    "get_act_patch_resid_mid",
    "get_act_patch_attn_out",
    "get_act_patch_mlp_out",
    "get_act_patch_attn_head_out_by_pos",
    "get_act_patch_attn_head_q_by_pos",
    "get_act_patch_attn_head_k_by_pos",
    "get_act_patch_attn_head_v_by_pos",
    "get_act_patch_attn_head_pattern_by_pos",
    "get_act_patch_attn_head_pattern_dest_src_pos",
    "get_act_patch_attn_head_out_all_pos",
    "get_act_patch_attn_head_q_all_pos",
    "get_act_patch_attn_head_k_all_pos",
    "get_act_patch_attn_head_v_all_pos",
    "get_act_patch_attn_head_pattern_all_pos",
    "get_act_patch_attn_head_all_pos_every",
    "get_act_patch_attn_head_by_pos_every",
    "get_act_patch_block_every",
    "get_act_patch_direct_path",
    "get_act_patch_direct_path_all_sources",
    "attribution",
]

# ---- TransformerLens's functions --------------------------------------------------------------


def generic_activation_patch(
    model: Any,
    corrupted_tokens: Int[Tensor, "batch pos"],
    clean_cache: Any,
    patching_metric: MetricFn | Mapping[str, MetricFn],
    patch_setter: Callable[..., Tensor],
    activation_name: str,
    index_axis_names: Sequence[AxisNames] | None = None,
    index_df: pd.DataFrame | None = None,
    return_index_df: bool = False,
    *,
    reduce: Literal["scalar", "mean", "none"] = "scalar",
    baseline: bool = False,
    final_logits_only: bool = False,
    max_logits_gb: float = 1.0,
) -> Tensor | tuple[Tensor, pd.DataFrame] | PatchingResult:
    tokens = as_tokens(model, corrupted_tokens)
    sweep = make_sweep(
        model,
        tokens,
        patching_metric,
        patch_setter,
        activation_name,
        index_axis_names,
        index_df,
        return_index_df,
        reduce,
        baseline,
    )
    run_sweeps(model, tokens, clean_cache, [sweep], final_logits_only, max_logits_gb)
    return sweep.result()


generic_activation_patch.__doc__ = (
    (tl.generic_activation_patch.__doc__ or "")
    + """
    vlens: every cell × corrupted prompt is one request of one batched vLLM call (split into
    several calls when the logits would exceed ``max_logits_gb``); ``final_logits_only=True``
    gives the metric the last position's logits only, ``[batch, 1, d_vocab]``.
    """
)


def _specialised(name: str) -> partial:
    """``generic_activation_patch`` with the setter, activation and axes TransformerLens gives
    its function ``name``, and its docstring."""
    theirs = getattr(tl, name)
    ours = partial(generic_activation_patch, **theirs.keywords)
    ours.__doc__ = theirs.__doc__
    return ours


get_act_patch_resid_pre = _specialised("get_act_patch_resid_pre")
get_act_patch_resid_mid = _specialised("get_act_patch_resid_mid")
get_act_patch_attn_out = _specialised("get_act_patch_attn_out")
get_act_patch_mlp_out = _specialised("get_act_patch_mlp_out")
get_act_patch_attn_head_out_by_pos = _specialised("get_act_patch_attn_head_out_by_pos")
get_act_patch_attn_head_q_by_pos = _specialised("get_act_patch_attn_head_q_by_pos")
get_act_patch_attn_head_k_by_pos = _specialised("get_act_patch_attn_head_k_by_pos")
get_act_patch_attn_head_v_by_pos = _specialised("get_act_patch_attn_head_v_by_pos")
get_act_patch_attn_head_pattern_by_pos = _specialised("get_act_patch_attn_head_pattern_by_pos")
get_act_patch_attn_head_pattern_dest_src_pos = _specialised(
    "get_act_patch_attn_head_pattern_dest_src_pos"
)
get_act_patch_attn_head_out_all_pos = _specialised("get_act_patch_attn_head_out_all_pos")
get_act_patch_attn_head_q_all_pos = _specialised("get_act_patch_attn_head_q_all_pos")
get_act_patch_attn_head_k_all_pos = _specialised("get_act_patch_attn_head_k_all_pos")
get_act_patch_attn_head_v_all_pos = _specialised("get_act_patch_attn_head_v_all_pos")
get_act_patch_attn_head_pattern_all_pos = _specialised("get_act_patch_attn_head_pattern_all_pos")


# ---- the *_every helpers: several sweeps, one batched call ------------------------------------


def _every(
    functions: Sequence[partial],
    model: Any,
    corrupted_tokens: Any,
    clean_cache: Any,
    metric: MetricFn | Mapping[str, MetricFn],
    kwargs: dict[str, Any],
) -> list[Tensor | PatchingResult]:
    """The sweeps of a ``*_every`` helper, run together; a requested baseline evaluated once
    (with the first sweep), and tensor results given the result shape then, as TransformerLens
    does."""
    kwargs = dict(kwargs)
    baseline = bool(kwargs.pop("baseline", False))
    final_only = bool(kwargs.pop("final_logits_only", False))
    budget = float(kwargs.pop("max_logits_gb", 1.0))
    reduce = kwargs.pop("reduce", "scalar")
    if kwargs:
        raise TypeError(f"unexpected keyword arguments {sorted(kwargs)}")
    tokens = as_tokens(model, corrupted_tokens)
    sweeps = []
    for i, function in enumerate(functions):
        keywords = function.keywords
        sweeps.append(
            make_sweep(
                model,
                tokens,
                metric,
                keywords["patch_setter"],
                keywords["activation_name"],
                keywords["index_axis_names"],
                None,
                False,
                reduce,
                baseline and i == 0,
            )
        )
    run_sweeps(model, tokens, clean_cache, sweeps, final_only, budget)
    results: list[Tensor | PatchingResult] = []
    for function, sweep in zip(functions, sweeps):
        out = sweep.result()
        if baseline and isinstance(out, Tensor):
            # TransformerLens names the pattern sweeps' axes head_index/dest_pos here too.
            out = tl._wrap_tensor_result(out, function.keywords["index_axis_names"])
        results.append(out)
    return results


def _stacked_heads(results: list[Any], model: Any, by_pos: bool) -> Tensor | PatchingResult:
    """TransformerLens's stacking of the five head sweeps (out, q, k, v, pattern)."""
    if all(isinstance(r, Tensor) for r in results):
        n_heads = results[0].size(-1)
        tensors = list(results)
        for i in (2, 3):  # GQA: k and v have n_key_value_heads, padded with zeros
            tensors[i] = torch.nn.functional.pad(tensors[i], (0, n_heads - tensors[i].size(-1)))
        if by_pos:  # the pattern sweep is [layer, head, dest_pos]
            tensors[4] = tensors[4].permute(0, 2, 1)
        return torch.stack(tensors, dim=0)
    order = ("layer", "pos", "head") if by_pos else ("layer", "head")
    return tl._stack_patch_types(
        results, axis_order=order, n_heads=model.cfg.n_heads, type_names=tl._HEAD_TYPES
    )


def get_act_patch_attn_head_all_pos_every(
    model: Any, corrupted_tokens: Any, clean_cache: Any, metric: Any, **kwargs: Any
) -> Tensor | PatchingResult:
    functions = (
        get_act_patch_attn_head_out_all_pos,
        get_act_patch_attn_head_q_all_pos,
        get_act_patch_attn_head_k_all_pos,
        get_act_patch_attn_head_v_all_pos,
        get_act_patch_attn_head_pattern_all_pos,
    )
    results = _every(functions, model, corrupted_tokens, clean_cache, metric, kwargs)
    return _stacked_heads(results, model, by_pos=False)


def get_act_patch_attn_head_by_pos_every(
    model: Any, corrupted_tokens: Any, clean_cache: Any, metric: Any, **kwargs: Any
) -> Tensor | PatchingResult:
    functions = (
        get_act_patch_attn_head_out_by_pos,
        get_act_patch_attn_head_q_by_pos,
        get_act_patch_attn_head_k_by_pos,
        get_act_patch_attn_head_v_by_pos,
        get_act_patch_attn_head_pattern_by_pos,
    )
    results = _every(functions, model, corrupted_tokens, clean_cache, metric, kwargs)
    return _stacked_heads(results, model, by_pos=True)


def get_act_patch_block_every(
    model: Any, corrupted_tokens: Any, clean_cache: Any, metric: Any, **kwargs: Any
) -> Tensor | PatchingResult:
    functions = (get_act_patch_resid_pre, get_act_patch_attn_out, get_act_patch_mlp_out)
    results = _every(functions, model, corrupted_tokens, clean_cache, metric, kwargs)
    if all(isinstance(r, Tensor) for r in results):
        return torch.stack(results, dim=0)
    return tl._stack_patch_types(
        results, axis_order=("layer", "pos"), n_heads=0, type_names=tl._BLOCK_TYPES
    )


for _name in (
    "get_act_patch_attn_head_all_pos_every",
    "get_act_patch_attn_head_by_pos_every",
    "get_act_patch_block_every",
):
    globals()[_name].__doc__ = getattr(tl, _name).__doc__


# ---- direct path patching ----------------------------------------------------------------------


def get_act_patch_direct_path(
    model: Any,
    corrupted_tokens: Int[Tensor, "batch pos"],
    clean_cache: Any,
    corrupted_cache: Any,
    patching_metric: MetricFn,
    src_layer: int,
    src_head: int,
    component: Literal["q", "k", "v"] = "q",
    verbose: bool = True,
) -> Float[Tensor, "n_layers n_heads"]:
    """TransformerLens's direct path patching: the source head's clean-minus-corrupted write
    (``hook_z @ W_O``) added at every position to one later head's own copy of its block input
    (``hook_{component}_input``), every other reader seeing the corrupted run; one cell per later
    head, run as requests of one batched call. Rows ``l <= src_layer`` are 0.0 placeholders."""
    del verbose  # one call: vLLM's own progress bar
    if component not in ("q", "k", "v"):
        raise ValueError(f"component must be 'q', 'k' or 'v', got {component!r}")
    cfg = model.cfg
    n_kv = getattr(cfg, "n_key_value_heads", None)
    if component != "q" and n_kv is not None and n_kv != cfg.n_heads:
        raise ValueError(
            f"component={component!r} is unsupported here: n_key_value_heads={n_kv} for "
            f"n_heads={cfg.n_heads} (grouped keys and values), so a query head has no key or "
            f"value input of its own; component='q' is available"
        )
    tokens = as_tokens(model, corrupted_tokens)
    z = f"blocks.{src_layer}.attn.hook_z"
    W_O = model.blocks[src_layer].attn.W_O[src_head].to(clean_cache[z].device)
    delta = clean_cache[z][:, :, src_head] @ W_O - corrupted_cache[z][:, :, src_head] @ W_O
    layers = range(src_layer + 1, cfg.n_layers)
    _, resid = model.run_with_cache(tokens, names_filter=[f"blocks.{layer}.hook_resid_pre" for layer in layers])
    activation = f"{component}_input"
    # The patched copy of head h: the corrupted block input (the edit reaches no earlier layer)
    # plus the source's write, standing in for the clean activation of a patch sweep.
    patched = {
        get_act_name(activation, layer=layer): (resid[f"blocks.{layer}.hook_resid_pre"]
                                                + delta.to(resid[f"blocks.{layer}.hook_resid_pre"].device)
                                                )[:, :, None, :].expand(-1, -1, cfg.n_heads, -1)
        for layer in layers
    }
    results = torch.zeros(cfg.n_layers, cfg.n_heads, device=cfg.device)
    if not patched:
        return results
    index_df = pd.DataFrame([(layer, head) for layer in layers for head in range(cfg.n_heads)],
                            columns=["layer", "head"])
    values = generic_activation_patch(model, tokens, patched, patching_metric,
                                      layer_head_vector_patch_setter, activation, index_df=index_df)
    results[src_layer + 1 :] = values.reshape(len(layers), cfg.n_heads).to(results.device)
    return results


def get_act_patch_direct_path_all_sources(
    model: Any,
    corrupted_tokens: Int[Tensor, "batch pos"],
    clean_cache: Any,
    corrupted_cache: Any,
    patching_metric: MetricFn,
    component: Literal["q", "k", "v"] = "q",
    verbose: bool = True,
) -> Float[Tensor, "n_layers n_heads n_layers n_heads"]:
    """:func:`get_act_patch_direct_path` from every source head: ``results[sl, sh, dl, dh]``,
    0.0 where ``dl <= sl``."""
    cfg = model.cfg
    return torch.stack([
        torch.stack([
            get_act_patch_direct_path(model, corrupted_tokens, clean_cache, corrupted_cache,
                                      patching_metric, layer, head, component, verbose)
            for head in range(cfg.n_heads)
        ])
        for layer in range(cfg.n_layers)
    ])
