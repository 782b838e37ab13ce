"""One activation-patching sweep as vLLM requests: every cell × corrupted prompt a request with
its own hook (``prompt_hooks``), submitted together (or in a few calls, bounded by the logits
they hand back), the metric applied to each cell's logits afterwards. The public functions that
build sweeps are in :mod:`vlens.patching`."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
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

#: TransformerLens's setters: each writes the same cells of every prompt of the batch, so one
#: prompt's ``[1, ...]`` activations give the same rows as the whole batch's.
ROW_WISE_SETTERS = frozenset(
    {
        layer_pos_patch_setter,
        layer_pos_head_vector_patch_setter,
        layer_head_vector_patch_setter,
        layer_head_pattern_patch_setter,
        layer_head_pos_pattern_patch_setter,
        layer_head_dest_src_pos_pattern_patch_setter,
    }
)

#: The names whose hooks need the worker to form attention itself (pattern patching).
_FORMED_IN_WORKER = ("pattern", "attn_scores")

#: The name vLLM's sampler reads: each request's logits at its last position.
_SAMPLER_LOGITS = "sampler.hook_logits"

_GB = 1024**3


# ---- one sweep (one generic_activation_patch) -------------------------------------------------


@dataclass
class Sweep:
    """One ``generic_activation_patch``'s cells, metrics and result store."""

    activation_name: str
    patch_setter: Callable[[Tensor, Sequence[int], Tensor], Tensor]
    index_df: pd.DataFrame
    axis_names: list[str] | None  # None: index_df was given (flat output)
    metrics: dict[str, MetricFn]
    has_metric_axis: bool
    reduce: str
    baseline: bool
    return_index_df: bool
    store: Tensor
    baseline_values: Tensor | None = None
    cells: list[list[int]] = field(default_factory=list)

    @property
    def flat(self) -> bool:
        return self.axis_names is None

    def evaluate(self, logits: Tensor) -> Tensor:
        """Every metric on one cell's logits, ``[metric, batch?]``, checked as TransformerLens
        checks them."""
        batch = logits.shape[0]
        rows = []
        for name, metric in self.metrics.items():
            value = torch.as_tensor(metric(logits))
            if self.reduce != "scalar":
                if value.ndim != 1 or value.shape[0] != batch:
                    raise ValueError(
                        f"patching_metric {name!r} must return a [batch] tensor of length {batch} "
                        f"under reduce={self.reduce!r}, got shape {tuple(value.shape)}"
                    )
            elif value.ndim != 0:
                raise ValueError(
                    f"patching_metric {name!r} must return a scalar under reduce='scalar', got "
                    f"shape {tuple(value.shape)}; return a [batch] tensor and pass reduce='mean' "
                    "or reduce='none' to keep per-example values"
                )
            rows.append(value.detach())
        return torch.stack(rows).to(self.store.device, self.store.dtype)

    def record(self, cell: int, logits: Tensor) -> None:
        values = self.evaluate(logits)
        if self.flat:
            self.store[:, cell] = values
        else:
            self.store[(slice(None), *self.cells[cell])] = values

    def result(self) -> Tensor | tuple[Tensor, pd.DataFrame] | PatchingResult:
        store, baseline = self.store, self.baseline_values
        if self.reduce == "mean":
            store = store.mean(dim=-1)
            baseline = None if baseline is None else baseline.mean(dim=-1)
        if not (self.has_metric_axis or self.reduce == "none" or self.baseline):
            return (store[0], self.index_df) if self.return_index_df else store[0]
        if baseline is not None and not self.has_metric_axis:
            baseline = baseline[0]
        return PatchingResult(
            values=store if self.has_metric_axis else store[0],
            axis_names=[] if self.flat else list(self.axis_names or []),
            index_df=self.index_df,
            metric_names=list(self.metrics),
            reduced=self.reduce != "none",
            baseline=baseline,
            has_metric_axis=self.has_metric_axis,
        )


def make_sweep(
    model: Any,
    corrupted_tokens: Tensor,
    patching_metric: MetricFn | Mapping[str, MetricFn],
    patch_setter: Callable[..., Tensor],
    activation_name: str,
    index_axis_names: Sequence[AxisNames] | None,
    index_df: pd.DataFrame | None,
    return_index_df: bool,
    reduce: str,
    baseline: bool,
) -> Sweep:
    """A sweep's cells and store, with TransformerLens's checks and index rules."""
    if reduce not in ("scalar", "mean", "none"):
        raise ValueError(f"reduce must be one of ('scalar', 'mean', 'none'), got {reduce!r}")
    if isinstance(patching_metric, Mapping):
        metrics, has_metric_axis = dict(patching_metric), True
        if not metrics:
            raise ValueError("patching_metric mapping must contain at least one metric")
    else:
        metrics, has_metric_axis = {"metric": patching_metric}, False
    if return_index_df and (has_metric_axis or reduce == "none" or baseline):
        raise ValueError(
            "return_index_df only applies to the tensor return; a PatchingResult carries index_df"
        )
    if index_df is None:
        if index_axis_names is None:
            raise ValueError("give index_axis_names or index_df")
        heads = model.cfg.n_heads
        if activation_name in ("k", "v") and getattr(model.cfg, "n_key_value_heads", None):
            heads = model.cfg.n_key_value_heads
        n_pos = int(corrupted_tokens.shape[-1])
        ranges = {"layer": model.cfg.n_layers, "pos": n_pos, "src_pos": n_pos, "dest_pos": n_pos}
        ranges |= {"head_index": heads, "head": heads}
        shape = [ranges[axis] for axis in index_axis_names]
        index_df = make_df_from_ranges(shape, list(index_axis_names))
        cell_shape, axis_names = tuple(shape), list(index_axis_names)
    else:
        if index_axis_names is not None:
            raise ValueError("give index_axis_names or index_df, not both")
        cell_shape, axis_names = (len(index_df),), None
    batch = int(corrupted_tokens.shape[0])
    per_example = (batch,) if reduce != "scalar" else ()
    store = torch.zeros((len(metrics), *cell_shape, *per_example), device=model.cfg.device)
    sweep = Sweep(
        activation_name,
        patch_setter,
        index_df,
        axis_names,
        metrics,
        has_metric_axis,
        reduce,
        baseline,
        return_index_df,
        store,
    )
    sweep.cells = [[int(i) for i in row] for row in index_df.itertuples(index=False)]
    return sweep


# ---- hooks ------------------------------------------------------------------------------------


class _Clean:
    """One name's clean activation ``[batch, ...]`` in TransformerLens's layout, shared by the
    hooks of every cell at that name: copied once to where the hooks' values are (a GPU), not
    once per request. ``pos_axes``: its axes along positions (the first: the positions of the
    rows a step computes; the others, keys of an attention pattern: the positions seen so far)."""

    def __init__(self, value: Tensor, pos_axes: tuple[int, ...]) -> None:
        self.value = value
        self.pos_axes = pos_axes
        self.copies: dict[tuple[torch.device, torch.dtype], Tensor] = {}

    def like(self, value: Tensor) -> Tensor:
        if self.value.device == value.device and self.value.dtype == value.dtype:
            return self.value
        key = (value.device, value.dtype)
        if key not in self.copies:
            self.copies[key] = self.value.to(value.device, value.dtype)
        return self.copies[key]


class _PatchHook:
    """The hook of one (cell, prompt) request: ``patch_setter`` applied to this request's rows."""

    def __init__(
        self, setter: Callable[..., Tensor], index: list[int], clean: _Clean, prompt: int
    ) -> None:
        self.setter = setter
        self.index = index
        self.clean = clean
        self.prompt = prompt
        self.row_wise = setter in ROW_WISE_SETTERS

    def __call__(self, value: Tensor, hook: Any) -> Tensor:
        clean = self.clean.like(value)
        if self.row_wise:
            clean, batch_row = clean[self.prompt : self.prompt + 1], 0
        else:
            batch_row = self.prompt
        if clean.shape[0] == 1 and value.shape == clean.shape:
            # The whole prompt in one step (the usual case): patch the hook's own tensor.
            return self.setter(value, self.index, clean)
        rows = [slice(None)] * value.ndim
        for n, axis in enumerate(self.clean.pos_axes):
            width = value.shape[axis]
            first = hook.first_position if n == 0 else 0
            rows[axis] = slice(first, first + width)
        full = clean.clone()
        full[(batch_row, *rows[1:])] = value[0]
        patched = self.setter(full, self.index, clean)
        return patched[(slice(batch_row, batch_row + 1), *rows[1:])]


def _position_axes(model: Any, name: str, clean: Tensor) -> tuple[int, ...]:
    """The position axes of ``name`` in TransformerLens's layout, batch axis included: from the
    model's shape words where it has them ("head query_pos key_pos"), else the pattern rule."""
    spec = getattr(model, "hook_specs", {}).get(name)
    words = getattr(spec, "shape", None)
    if isinstance(words, str):
        axes = tuple(1 + i for i, word in enumerate(words.split()) if word.endswith("pos"))
        if axes:
            return axes
    if name.endswith(("hook_pattern", "hook_attn_scores")) and clean.ndim == 4:
        return (2, 3)
    return (1,)


def _check_hookable(model: Any, name: str, activation_name: str) -> None:
    """Refuse, before any request runs, a name this engine cannot hook."""
    try:
        with model.hooks(fwd_hooks=[(name, _unchanged)]):
            pass
    except ValueError as error:
        if activation_name in _FORMED_IN_WORKER:
            raise NotImplementedError(
                f"{activation_name} patching needs hooks that edit {name}, which this engine "
                f"cannot run yet: {error}"
            ) from error
        raise


def _unchanged(value: Tensor, hook: Any) -> None:
    return None


# ---- running sweeps ---------------------------------------------------------------------------


def run_sweeps(
    model: Any,
    corrupted_tokens: Tensor,
    clean_cache: Any,
    sweeps: Sequence[Sweep],
    final_logits_only: bool,
    max_logits_gb: float,
) -> None:
    """Every cell of ``sweeps`` × every corrupted prompt (and each requested baseline, unpatched)
    as requests of as few vLLM calls as ``max_logits_gb`` allows; each cell's metrics recorded
    as soon as its call returns."""
    batch, n_pos = corrupted_tokens.shape
    # (sweep, cell, each prompt's hooks); cell None: the sweep's baseline, unpatched
    jobs: list[tuple[Sweep, int | None, list[list[Any]]]] = []
    cleans: dict[str, _Clean] = {}
    for sweep in sweeps:
        if sweep.baseline:
            jobs.append((sweep, None, [[] for _ in range(batch)]))
        for cell, index in enumerate(sweep.cells):
            name = get_act_name(sweep.activation_name, layer=index[0])
            if name not in cleans:
                _check_hookable(model, name, sweep.activation_name)
                clean = clean_cache[name]
                cleans[name] = _Clean(clean, _position_axes(model, name, clean))
            hooks = [
                [(name, _PatchHook(sweep.patch_setter, index, cleans[name], prompt))]
                for prompt in range(batch)
            ]
            jobs.append((sweep, cell, hooks))
    per_request = (1 if final_logits_only else n_pos) * model.cfg.d_vocab * 4
    jobs_per_call = max(1, int(max_logits_gb * _GB) // (per_request * batch))
    for start in range(0, len(jobs), jobs_per_call):
        chunk = jobs[start : start + jobs_per_call]
        prompt_hooks = [hooks for _, _, job_hooks in chunk for hooks in job_hooks]
        tokens = corrupted_tokens.repeat(len(chunk), 1)
        logits = _logits(model, tokens, prompt_hooks, final_logits_only)
        for j, (sweep, cell, _) in enumerate(chunk):
            cell_logits = logits[j * batch : (j + 1) * batch]
            if cell is None:
                sweep.baseline_values = sweep.evaluate(cell_logits)
            else:
                sweep.record(cell, cell_logits)
        del logits


def _logits(
    model: Any, tokens: Tensor, prompt_hooks: list[list[Any]], final_only: bool
) -> Float[Tensor, "request pos d_vocab"]:
    """One vLLM call: every row of ``tokens`` with its own hooks; its logits at every position,
    or (``final_only``) at the last, ``[request, 1, d_vocab]``, as the sampler got them."""
    if not final_only:
        return model.run_with_hooks(tokens, return_type="logits", prompt_hooks=prompt_hooks)
    _, cache = model.run_with_cache(
        tokens, names_filter=[_SAMPLER_LOGITS], return_type=None, prompt_hooks=prompt_hooks
    )
    return cache[_SAMPLER_LOGITS]


def as_tokens(model: Any, corrupted_tokens: Any) -> Int[Tensor, "batch pos"]:
    if not hasattr(model, "engine") or not hasattr(model, "run_with_cache"):
        raise TypeError(
            f"vlens.patching runs on a vlens HookedVLLM, not {type(model).__name__}: use "
            "transformer_lens.patching for TransformerLens models"
        )
    tokens = torch.as_tensor(corrupted_tokens)
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2 or tokens.dtype.is_floating_point:
        raise ValueError(
            f"corrupted_tokens must be token ids [batch, pos], got {tuple(tokens.shape)}"
        )
    return tokens.cpu()


