"""``vlens.patching``: TransformerLens's activation patching as one batched vLLM call.

Its results equal (1) a loop of single ``run_with_hooks`` calls on the same vlens engine, one
per patched cell, as TransformerLens computes them (≤ 1e-5), and (2) TransformerLens's own
``transformer_lens.patching`` on its ``TransformerBridge`` of the same checkpoint (≤ 1e-4
relative). Prompts are token ids (the tokenization of strings is not under test here).
"""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd
import pytest
import torch
import transformer_lens.patching as tl_patching
from torch import Tensor
from transformer_lens.utilities import get_act_name

from vlens import HookedVLLM, patching

LOOP_TOL = 1e-5
BRIDGE_RTOL = 1e-4
ANSWERS = torch.tensor([[3, 4], [7, 5]])  # (correct, incorrect) per prompt


def prompts(length: int = 6, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Two clean prompts and their corrupted versions (two tokens changed), BOS first."""
    generator = torch.Generator().manual_seed(seed)
    clean = torch.randint(2, 500, (2, length), generator=generator)
    clean[:, 0] = 0
    corrupted = clean.clone()
    corrupted[:, 2] = (corrupted[:, 2] + 1) % 500
    corrupted[:, length - 2] = (corrupted[:, length - 2] + 7) % 500
    return clean, corrupted


def per_prompt_diff(logits: Tensor) -> Tensor:
    """Each prompt's correct minus incorrect logit at the last position: ``[batch]``."""
    answers = ANSWERS[: logits.shape[0]].to(logits.device)
    final = logits[:, -1].gather(-1, answers)
    return final[:, 0] - final[:, 1]


def mean_diff(logits: Tensor) -> Tensor:
    return per_prompt_diff(logits).mean()


def loop_reference(
    model: HookedVLLM,
    corrupted: Tensor,
    clean_cache,
    metric: Callable[[Tensor], Tensor],
    setter: Callable,
    activation_name: str,
    index_df: pd.DataFrame,
) -> Tensor:
    """TransformerLens's algorithm, cell by cell: one ``run_with_hooks`` over the corrupted batch
    per row of ``index_df``, the setter given the clean activations of the prompts whose rows
    the hook sees (``hook.requests``: the whole batch where its prompts run together)."""
    values = []
    for index in index_df.itertuples(index=False):
        index = [int(i) for i in index]
        name = get_act_name(activation_name, layer=index[0])
        clean = clean_cache[name]

        def hook(value: Tensor, hook, index=index, clean=clean) -> Tensor:
            return setter(value, index, clean[list(hook.requests)])

        logits = model.run_with_hooks(corrupted, fwd_hooks=[(name, hook)])
        values.append(metric(logits))
    return torch.stack(values)


def assert_close_relative(ours: Tensor, theirs: Tensor, rtol: float = BRIDGE_RTOL) -> None:
    assert ours.shape == theirs.shape
    scale = theirs.abs().max().clamp_min(1e-6)
    assert ((ours - theirs).abs().max() / scale).item() <= rtol


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def setup(request, clean_runs):
    """The engine, TransformerLens's bridge, this module's prompts and each side's clean cache."""
    return clean_runs(request.param, *prompts())


SWEEPS = {
    "resid_pre": (
        patching.get_act_patch_resid_pre,
        tl_patching.get_act_patch_resid_pre,
        tl_patching.layer_pos_patch_setter,
        ("layer", "pos"),
    ),
    "attn_head_out_all_pos": (
        patching.get_act_patch_attn_head_out_all_pos,
        tl_patching.get_act_patch_attn_head_out_all_pos,
        tl_patching.layer_head_vector_patch_setter,
        ("layer", "head"),
    ),
}


@pytest.mark.parametrize("sweep", list(SWEEPS))
def test_sweep_equals_loop_of_run_with_hooks(setup, sweep):
    model, _, _, corrupted, cache, _ = setup
    ours_fn, tl_fn, setter, axes = SWEEPS[sweep]
    ours = ours_fn(model, corrupted, cache, mean_diff)
    activation = tl_fn.keywords["activation_name"]
    index_df = patching.make_df_from_ranges(list(ours.shape), list(axes))
    loop = loop_reference(model, corrupted, cache, mean_diff, setter, activation, index_df)
    width = corrupted.shape[1] if "pos" in axes else model.cfg.n_heads
    assert ours.shape == (model.cfg.n_layers, width)
    torch.testing.assert_close(ours.flatten(), loop, rtol=0, atol=LOOP_TOL)
    assert loop.std() > 0.01, "the patches must change the metric for the test to mean anything"


@pytest.mark.parametrize("sweep", list(SWEEPS))
def test_sweep_equals_transformer_lens(setup, sweep):
    model, reference, _, corrupted, cache, reference_cache = setup
    ours_fn, tl_fn, _, _ = SWEEPS[sweep]
    ours = ours_fn(model, corrupted, cache, mean_diff)
    with torch.no_grad():
        theirs = tl_fn(reference, corrupted, reference_cache, mean_diff)
    assert_close_relative(ours, theirs)


def test_custom_index_df(setup):
    """A flat sweep over chosen (layer, pos, head) cells of hook_z, as TransformerLens runs it."""
    model, reference, _, corrupted, cache, reference_cache = setup
    index_df = pd.DataFrame(
        [[0, 1, 0], [1, 2, 1], [2, 4, 3], [1, 5, 2], [0, 2, 3]], columns=["layer", "pos", "head"]
    )
    setter = tl_patching.layer_pos_head_vector_patch_setter
    ours, ours_df = patching.generic_activation_patch(
        model, corrupted, cache, mean_diff, setter, "z", index_df=index_df, return_index_df=True
    )
    assert ours_df is index_df and ours.shape == (len(index_df),)
    loop = loop_reference(model, corrupted, cache, mean_diff, setter, "z", index_df)
    torch.testing.assert_close(ours, loop, rtol=0, atol=LOOP_TOL)
    with torch.no_grad():
        theirs = tl_patching.generic_activation_patch(
            reference, corrupted, reference_cache, mean_diff, setter, "z", index_df=index_df
        )
    assert_close_relative(ours, theirs)


def test_metric_mapping_per_example_with_baseline(setup):
    """A mapping of metrics with reduce="none" and baseline=True: TransformerLens's
    PatchingResult, [metric, layer, pos, batch], and the unpatched corrupted metric."""
    model, reference, _, corrupted, cache, reference_cache = setup
    metrics = {"diff": per_prompt_diff, "logsumexp": lambda logits: logits[:, -1].logsumexp(-1)}
    ours = patching.get_act_patch_resid_pre(
        model, corrupted, cache, metrics, reduce="none", baseline=True
    )
    with torch.no_grad():
        theirs = tl_patching.get_act_patch_resid_pre(
            reference, corrupted, reference_cache, metrics, reduce="none", baseline=True
        )
    assert isinstance(ours, tl_patching.PatchingResult)
    assert ours.values.shape == (2, model.cfg.n_layers, corrupted.shape[1], 2)
    assert ours.metric_names == theirs.metric_names == ["diff", "logsumexp"]
    assert ours.axis_names == theirs.axis_names and not ours.reduced
    assert_close_relative(ours.values, theirs.values)
    assert_close_relative(ours.baseline, theirs.baseline)
    unpatched = model(corrupted)
    torch.testing.assert_close(
        ours["diff"].baseline, per_prompt_diff(unpatched), rtol=0, atol=LOOP_TOL
    )
    # Patching layer 0 at position 0 (the BOS: clean and corrupted agree there) changes nothing.
    torch.testing.assert_close(
        ours["diff"].values[0, 0], ours["diff"].baseline, rtol=0, atol=LOOP_TOL
    )


def test_final_logits_only_and_split_calls_change_nothing(setup):
    model, _, _, corrupted, cache, _ = setup
    whole = patching.get_act_patch_attn_out(model, corrupted, cache, mean_diff)
    final = patching.get_act_patch_attn_out(
        model, corrupted, cache, mean_diff, final_logits_only=True
    )
    # A budget of a few cells' logits: several vLLM calls.
    split = patching.get_act_patch_attn_out(model, corrupted, cache, mean_diff, max_logits_gb=1e-4)
    torch.testing.assert_close(final, whole, rtol=0, atol=LOOP_TOL)
    torch.testing.assert_close(split, whole, rtol=0, atol=0)


def test_block_every_stacks_its_sweeps(setup):
    model, _, _, corrupted, cache, _ = setup
    every = patching.get_act_patch_block_every(model, corrupted, cache, mean_diff)
    parts = [
        patching.get_act_patch_resid_pre(model, corrupted, cache, mean_diff),
        patching.get_act_patch_attn_out(model, corrupted, cache, mean_diff),
        patching.get_act_patch_mlp_out(model, corrupted, cache, mean_diff),
    ]
    torch.testing.assert_close(every, torch.stack(parts), rtol=0, atol=0)


def test_every_helpers_equal_transformer_lens(setup):
    """The *_every helpers (their sweeps in one batched call) stack as TransformerLens's do: the
    five head sweeps (k and v zero-padded to n_heads under GQA) as a tensor, and the block sweeps
    as a PatchingResult with a patch_type axis and one baseline."""
    model, reference, _, corrupted, cache, reference_cache = setup
    if not pattern_hooks_available(model):
        pytest.skip("this engine cannot edit hook_pattern")
    ours = patching.get_act_patch_attn_head_all_pos_every(model, corrupted, cache, mean_diff)
    with torch.no_grad():
        theirs = tl_patching.get_act_patch_attn_head_all_pos_every(
            reference, corrupted, reference_cache, mean_diff
        )
    assert ours.shape == (5, model.cfg.n_layers, model.cfg.n_heads)
    assert_close_relative(ours, theirs)
    ours = patching.get_act_patch_block_every(
        model, corrupted, cache, per_prompt_diff, reduce="none", baseline=True
    )
    with torch.no_grad():
        theirs = tl_patching.get_act_patch_block_every(
            reference, corrupted, reference_cache, per_prompt_diff, reduce="none", baseline=True
        )
    assert ours.axis_names == theirs.axis_names == ["patch_type", "layer", "pos"]
    assert ours.patch_type_names == theirs.patch_type_names
    assert ours.values.shape == (3, model.cfg.n_layers, corrupted.shape[1], 2)
    assert_close_relative(ours.values, theirs.values)
    assert_close_relative(ours.baseline, theirs.baseline)


def pattern_hooks_available(model: HookedVLLM) -> bool:
    try:
        with model.hooks(fwd_hooks=[("blocks.0.attn.hook_pattern", lambda x, hook: None)]):
            return True
    except ValueError:
        return False


PATTERN_CELLS = {  # setter → chosen cells (layer, head_index, dest_pos[, src_pos])
    tl_patching.layer_head_pos_pattern_patch_setter: [[0, 1, 5], [1, 0, 3], [2, 3, 5], [2, 2, 1]],
    tl_patching.layer_head_dest_src_pos_pattern_patch_setter: [
        [0, 1, 5, 2],
        [1, 3, 4, 0],
        [2, 0, 5, 5],
    ],
}


def test_attention_pattern_patching(setup):
    """Pattern patching (by destination position, and single entries) equals TransformerLens's,
    where this engine can edit hook_pattern; a clear NotImplementedError where it cannot."""
    model, reference, _, corrupted, cache, reference_cache = setup
    if not pattern_hooks_available(model):
        with pytest.raises(NotImplementedError, match="hook_pattern"):
            patching.get_act_patch_attn_head_pattern_by_pos(model, corrupted, cache, mean_diff)
        return
    for setter, cells in PATTERN_CELLS.items():
        columns = ["layer", "head_index", "dest_pos", "src_pos"][: len(cells[0])]
        index_df = pd.DataFrame(cells, columns=columns)
        ours = patching.generic_activation_patch(
            model, corrupted, cache, mean_diff, setter, "pattern", index_df=index_df
        )
        with torch.no_grad():
            theirs = tl_patching.generic_activation_patch(
                reference,
                corrupted,
                reference_cache,
                mean_diff,
                setter,
                "pattern",
                index_df=index_df,
            )
        assert_close_relative(ours, theirs)


# ---- chunked prefill ------------------------------------------------------------------------


CHUNKED_CELLS = {  # activation → (setter, chosen cells on both sides of position 16)
    "resid_pre": (tl_patching.layer_pos_patch_setter, [[0, 2], [1, 15], [1, 16], [2, 19], [0, 20]]),
    "v": (tl_patching.layer_pos_head_vector_patch_setter, [[0, 3, 1], [2, 18, 0]]),
    "pattern": (tl_patching.layer_head_pos_pattern_patch_setter, [[0, 1, 4], [1, 2, 17]]),
}


def test_chunked_prefill_patches_absolute_positions(hooked):
    """With 16 tokens a step, each 21-token prompt is prefilled in two steps, and a hook sees
    rows 0-15, then 16-20: patches land on the same positions as on an engine that prefills
    each prompt in one step."""
    whole, chunked = hooked("llama"), hooked("llama", max_num_batched_tokens=16, max_num_seqs=4)
    clean, corrupted = prompts(length=21, seed=1)
    _, cache = whole.run_with_cache(clean)
    seen = []
    chunked.run_with_hooks(
        corrupted[:1], prompt_hooks=[[("blocks.0.hook_resid_pre", lambda x, h: seen.append(h.length))]]
    )
    assert seen == [16, 5]
    for activation, (setter, cells) in CHUNKED_CELLS.items():
        if activation == "pattern" and not pattern_hooks_available(chunked):
            continue
        columns = {"resid_pre": ["layer", "pos"], "v": ["layer", "pos", "head"]}.get(
            activation, ["layer", "head_index", "dest_pos"]
        )
        index_df = pd.DataFrame(cells, columns=columns)
        expected = patching.generic_activation_patch(
            whole, corrupted, cache, mean_diff, setter, activation, index_df=index_df
        )
        got = patching.generic_activation_patch(
            chunked, corrupted, cache, mean_diff, setter, activation, index_df=index_df
        )
        torch.testing.assert_close(got, expected, rtol=0, atol=LOOP_TOL)


# ---- TransformerLens's own module on a vlens model -------------------------------------------


def test_transformer_lens_patching_runs_on_one_prompt(hooked):
    """transformer_lens.patching itself, on a vlens model with one corrupted prompt (one vLLM
    call per cell), gives vlens.patching's results."""
    model = hooked("llama")
    clean, corrupted = prompts()
    _, cache = model.run_with_cache(clean[:1])
    theirs = tl_patching.get_act_patch_attn_head_out_all_pos(model, corrupted[:1], cache, mean_diff)
    ours = patching.get_act_patch_attn_head_out_all_pos(model, corrupted[:1], cache, mean_diff)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=LOOP_TOL)


def test_transformer_lens_patching_runs_on_several_prompts(hooked):
    """With several prompts run together in one engine step, vlens hands TransformerLens's hook
    the call's batch, so transformer_lens.patching gives vlens.patching's results too."""
    model = hooked("llama")
    clean, corrupted = prompts()
    _, cache = model.run_with_cache(clean)
    theirs = tl_patching.get_act_patch_resid_pre(model, corrupted, cache, mean_diff)
    ours = patching.get_act_patch_resid_pre(model, corrupted, cache, mean_diff)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=LOOP_TOL)


def test_refusals(hooked, bridge):
    model = hooked("llama")
    clean, corrupted = prompts()
    _, cache = model.run_with_cache(clean)
    with pytest.raises(ValueError, match="reduce"):
        patching.get_act_patch_resid_pre(model, corrupted, cache, mean_diff, reduce="median")
    with pytest.raises(ValueError, match="scalar"):
        patching.get_act_patch_resid_pre(model, corrupted, cache, per_prompt_diff)
    with pytest.raises(TypeError, match="transformer_lens.patching"):
        patching.get_act_patch_resid_pre(bridge("llama"), corrupted, cache, mean_diff)
    with pytest.raises(ValueError, match="grouped keys and values"):
        patching.get_act_patch_direct_path(model, corrupted, cache, cache, mean_diff, 0, 0, "k")


@pytest.mark.parametrize("component", ["q", "v"])
def test_direct_path_patching_equals_transformer_lens(setup, component):
    """The edge from one head into each later head's own q (or v) input, patched as
    TransformerLens patches it on its bridge (v: gpt2 only, llama's values are grouped)."""
    model, reference, _, corrupted, cache, reference_cache = setup
    if component == "v" and model.cfg.n_key_value_heads not in (None, model.cfg.n_heads):
        pytest.skip("grouped values: refused as TransformerLens refuses it")
    _, corrupted_cache = model.run_with_cache(corrupted)
    ours = patching.get_act_patch_direct_path(model, corrupted, cache, corrupted_cache, mean_diff,
                                              0, 1, component)
    with torch.no_grad():
        _, reference_corrupted = reference.run_with_cache(corrupted)
        theirs = tl_patching.get_act_patch_direct_path(
            reference, corrupted, reference_cache, reference_corrupted, mean_diff, 0, 1, component,
            verbose=False,
        )
    assert ours.shape == (model.cfg.n_layers, model.cfg.n_heads)
    assert torch.all(ours[0] == 0) and ours[1:].std() > 1e-3
    assert_close_relative(ours, theirs)
