"""``vlens.patching.attribution`` equals attribution patching done by hand on TransformerLens's
bridge of the same checkpoint, as its ``Attribution_Patching_Demo`` does it (clean cache,
corrupted cache and gradients of the metric there, ``(clean - corrupted) * grad`` summed):
fp32, ≤ 1e-4 relative. The clean cache is vLLM's."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from vlens import patching

RELATIVE = 1e-4
ANSWERS = torch.tensor([[3, 4], [7, 5]])  # (correct, incorrect) per prompt


def prompts() -> tuple[Tensor, Tensor]:
    """Two clean prompts and their corrupted versions, which differ from position 2 on."""
    generator = torch.Generator().manual_seed(0)
    clean = torch.randint(2, 500, (2, 6), generator=generator)
    clean[:, 0] = 0
    corrupted = clean.clone()
    corrupted[:, 2] = (corrupted[:, 2] + 1) % 500
    corrupted[:, 4] = (corrupted[:, 4] + 7) % 500
    return clean, corrupted


def logit_diff(logits: Tensor) -> Tensor:
    last = logits[:, -1]
    answers = ANSWERS.to(last.device)
    return (last.gather(1, answers[:, :1]) - last.gather(1, answers[:, 1:])).mean()


def assert_relative(actual: Tensor, expected: Tensor) -> None:
    assert actual.shape == expected.shape
    error = (actual - expected.to(actual.device)).abs().max() / expected.abs().max()
    assert error <= RELATIVE, f"relative error {error:.2e} > {RELATIVE:.0e}"


def by_hand(bridge, clean: Tensor, corrupted: Tensor, names: list[str]) -> dict[str, Tensor]:
    """``(clean - corrupted) * grad`` at each of ``names``, unreduced, on the bridge."""
    _, clean_cache = bridge.run_with_cache(clean, names_filter=names)
    acts: dict[str, Tensor] = {}
    grads: dict[str, Tensor] = {}

    def save(into: dict[str, Tensor], name: str):
        def hook(tensor: Tensor, hook) -> None:
            into[name] = tensor.detach().clone()

        return hook

    with bridge.hooks(fwd_hooks=[(n, save(acts, n)) for n in names],
                      bwd_hooks=[(n, save(grads, n)) for n in names]):
        logit_diff(bridge(corrupted)).backward()
    return {n: (clean_cache[n] - acts[n]) * grads[n] for n in names}


def test_block_attribution_equals_the_bridges_by_hand(hooked, bridge):
    model, reference = hooked("llama"), bridge("llama")
    clean, corrupted = prompts()
    kinds = ["resid_pre", "attn_out", "mlp_out"]
    names = [f"blocks.{layer}.{hook}" for hook in ("hook_resid_pre", "hook_attn_out",
                                                    "hook_mlp_out")
             for layer in range(model.cfg.n_layers)]
    _, clean_cache = model.run_with_cache(clean, names_filter=names)
    ours = patching.attribution(model, corrupted, clean_cache, logit_diff, kinds)
    products = by_hand(reference, clean, corrupted, names)
    expected = torch.stack([
        torch.stack([products[names[k * model.cfg.n_layers + layer]].sum(dim=(0, 2))
                     for layer in range(model.cfg.n_layers)])
        for k in range(len(kinds))
    ])
    assert ours.shape == (3, model.cfg.n_layers, clean.shape[1])
    assert_relative(ours, expected)
    # before the first corrupted token both runs are the same (up to vLLM's and HuggingFace's
    # rounding): nothing to attribute there
    assert ours[:, :, :2].abs().max() <= RELATIVE * ours.abs().max()
    # one name alone: its row of the stack
    alone = patching.attribution(model, corrupted, clean_cache, logit_diff, "attn_out")
    assert_relative(alone, expected[1])


def test_head_attribution_by_position_and_over_all(hooked, bridge):
    model, reference = hooked("llama"), bridge("llama")
    clean, corrupted = prompts()
    names = [f"blocks.{layer}.attn.hook_z" for layer in range(model.cfg.n_layers)]
    _, clean_cache = model.run_with_cache(clean, names_filter=names)
    by_pos = patching.attribution(model, corrupted, clean_cache, logit_diff, "z")
    all_pos = patching.attribution(model, corrupted, clean_cache, logit_diff, "z",
                                   index_axis_names=("layer", "head"))
    products = by_hand(reference, clean, corrupted, names)
    assert_relative(by_pos, torch.stack([products[n].sum(dim=(0, 3)) for n in names]))
    assert_relative(all_pos, torch.stack([products[n].sum(dim=(0, 1, 3)) for n in names]))
    assert by_pos.shape == (model.cfg.n_layers, clean.shape[1], model.cfg.n_heads)


def test_what_attribution_cannot_do_is_refused(hooked):
    model = hooked("llama")
    clean, corrupted = prompts()
    _, clean_cache = model.run_with_cache(clean, names_filter=["blocks.0.hook_resid_pre"])
    with pytest.raises(ValueError, match="attribution patching reads"):
        patching.attribution(model, corrupted, clean_cache, logit_diff, "pattern")
    with pytest.raises(ValueError, match="index_axis_names"):
        patching.attribution(model, corrupted, clean_cache, logit_diff, "resid_pre",
                             index_axis_names=("layer", "head"))
    with pytest.raises(ValueError, match="one number"):
        patching.attribution(model, corrupted, clean_cache, lambda logits: logits[:, -1, 3],
                             "resid_pre")
    with pytest.raises(KeyError, match="blocks.1.hook_resid_pre"):
        patching.attribution(model, corrupted, clean_cache, logit_diff, "resid_pre")
