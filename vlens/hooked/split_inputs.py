"""Hook functions on TransformerLens's per-head attention inputs (``hook_q_input``,
``hook_k_input``, ``hook_v_input``, ``hook_attn_in``) placed where their edits can land: the
pair of functions :mod:`vlens.runtime.hooks.split_inputs` describes, given the checkpoint's norm
and projection weights of the block."""

from __future__ import annotations

import re

from vlens.names.weight_views import AnalysisWeights
from vlens.runtime.hooks.split_inputs import (
    Fork,
    KeepInput,
    Norm,
    Projection,
    RunOnCopies,
    split_of,
)
from vlens.runtime.transfer.messages import HookFunction

HooksByName = dict[str, tuple[HookFunction, ...]]


def placed(by_name: HooksByName, analysis: AnalysisWeights) -> HooksByName:
    """``by_name`` with each split input's functions replaced by the pair that runs them: the
    block input kept at ``hook_resid_pre`` after every function there, the copies made and
    edited at the first projection they feed, before the functions on that projection."""
    out = {name: list(functions) for name, functions in by_name.items() if split_of(name) is None}
    for name, functions in by_name.items():
        found = split_of(name)
        if found is None or not functions:
            continue
        keep_at, feeds = found
        layer = int(re.match(r"blocks\.(\d+)\.", name).group(1))  # type: ignore[union-attr]
        heads = analysis.n_kv_heads if [letter for letter, _ in feeds] in (["K"], ["V"]) else analysis.n_heads
        fork = Fork(name, heads, functions, ln1(analysis, layer))
        out.setdefault(keep_at, []).append(KeepInput(fork))
        for index, (letter, target) in enumerate(feeds):
            projection = Projection(analysis.qkv_weight(letter, layer), analysis.qkv_bias(letter, layer))
            out[target] = [RunOnCopies(fork, projection, runs=index == 0), *out.get(target, [])]
    return {name: tuple(functions) for name, functions in out.items()}


def ln1(analysis: AnalysisWeights, layer: int) -> Norm | None:
    """Block ``layer``'s norm before attention, as the model applies it; None where it has none
    (OLMo-2's post-norms)."""
    if analysis.names.ln1_w is None:
        return None
    return analysis.norm("ln1_w", "ln1_b", layer)
