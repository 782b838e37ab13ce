"""TransformerLens's ActivationCache analysis on vlens caches equals the same analysis on
TransformerLens's own cache of the same checkpoint (TransformerBridge, no weight processing)."""

from collections.abc import Callable

import pytest
import torch
from torch import Tensor
from transformer_lens import ActivationCache
from transformer_lens.model_bridge import TransformerBridge

from vlens import HookedVLLM

TEXT = "The analysis methods of TransformerLens run on vlens caches"
LAYER = 2

METHODS: dict[str, Callable] = {
    "accumulated_resid": lambda c, t: c.accumulated_resid(apply_ln=True, incl_mid=True),
    "decompose_resid": lambda c, t: c.decompose_resid(apply_ln=True),
    "stack_head_results": lambda c, t: c.stack_head_results(apply_ln=True),
    "stack_neuron_results": lambda c, t: c.stack_neuron_results(LAYER, apply_ln=True),
    "apply_ln_to_stack": lambda c, t: c.apply_ln_to_stack(c.decompose_resid(LAYER), LAYER),
    "logit_attrs": lambda c, t: c.logit_attrs(
        c.decompose_resid(pos_slice=slice(0, -1)),
        tokens=t[:, 1:],
        incorrect_tokens=t[:, :-1],
        pos_slice=slice(0, -1),
    ),
    "get_full_resid_decomposition": lambda c, t: c.get_full_resid_decomposition(
        expand_neurons=True, apply_ln=True
    ),
    "compute_head_results": lambda c, t: (c.compute_head_results(), c["result", 1])[1],
    "remove_batch_dim": lambda c, t: c.remove_batch_dim()["blocks.0.hook_resid_post"],
    "to": lambda c, t: c.to("cpu")["blocks.1.hook_mlp_out"],
}


@pytest.fixture(scope="module", params=["llama", "qwen3", "gpt2"])
def models(request, hooked, bridge) -> tuple[HookedVLLM, TransformerBridge]:
    """The session's engine and TransformerLens's own model of the same checkpoint."""
    return hooked(request.param), bridge(request.param)


@pytest.fixture(scope="module")
def caches(models) -> tuple[ActivationCache, ActivationCache, Tensor]:
    model, bridge = models
    tokens = model.to_tokens(TEXT)
    _, ours = model.run_with_cache(
        TEXT, names_filter=lambda n: "pattern" not in n and "scores" not in n
    )
    _, theirs = bridge.run_with_cache(tokens)
    return ours, theirs, tokens


@pytest.mark.parametrize("method", list(METHODS))
def test_method_matches_transformer_lens(caches, method):
    ours, theirs, tokens = caches
    a, b = METHODS[method](ours, tokens), METHODS[method](theirs, tokens)
    assert a.shape == b.shape
    # fp32 parity tolerance (parity/compare.py); sums over components add a little rounding.
    torch.testing.assert_close(a.float(), b.float(), rtol=1e-4, atol=1e-4)


def test_weight_views_equal_transformer_lens(models):
    model, bridge = models
    exact = {"rtol": 0, "atol": 0}  # the same checkpoint tensors, in the same layouts
    torch.testing.assert_close(model.W_U, bridge.W_U, **exact)
    torch.testing.assert_close(model.W_O, bridge.W_O, **exact)
    torch.testing.assert_close(model.W_out, bridge.W_out, **exact)
    token = model.token_lists("the")[0][0]
    for tokens in (token, torch.tensor([[3, 9], [5, 300]])):
        torch.testing.assert_close(
            model.tokens_to_residual_directions(tokens),
            bridge.tokens_to_residual_directions(tokens),
            **exact,
        )
