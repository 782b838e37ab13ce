"""The MoE members of the Granite and Ernie 4.5 families (GraniteMoe, GraniteMoeShared, Ernie 4.5
MoE): TransformerLens's bridge on every name but the routing where it has an adapter, the routing
as vLLM computes it, the shared expert's and the routed experts' terms, steering, and the refusals
(one routed expert; a hook on GraniteMoeShared's summed MLP output)."""

import pytest
import test_moe
import torch
from transformers import AutoConfig

from vlens.mappings import ernie4_5_moe, mapping_for
from vlens.names.derived import Batch
from vlens.names.resolve import UnknownHookName
from vlens.parity.compare import PROMPTS
from vlens.testing.tiny import tiny_model

ARCHS = ["granite_moe", "granite_moe_shared", "ernie4_5_moe"]
WITH_BRIDGE = ["granite_moe", "ernie4_5_moe"]  # TransformerLens 4.3 has no GraniteMoeShared adapter


@pytest.mark.parametrize("arch", WITH_BRIDGE)
def test_every_other_name_matches_the_bridge(hooked, arch):
    test_moe.test_every_other_name_matches_the_bridge(hooked, arch)


def test_bridge_routing_is_ours_scattered(hooked, bridge):
    """(The bridge's Ernie 4.5 MoE adapter has no routing hooks.)"""
    test_moe.test_bridge_routing_is_ours_scattered(hooked, bridge, "granite_moe")


@pytest.mark.parametrize("arch", ARCHS)
def test_asking_for_one_routed_expert_says_why(arch):
    test_moe.test_asking_for_one_routed_expert_says_why(arch)


@pytest.mark.parametrize("arch", ARCHS)
def test_steering_the_residual_stream_changes_the_logits(hooked, arch):
    model = hooked(arch)
    plain = model(PROMPTS[0])

    def steer(resid, hook):
        return resid + 3.0 * resid.norm(dim=-1, keepdim=True) * torch.ones_like(resid) / resid.shape[-1] ** 0.5

    steered = model.run_with_hooks(PROMPTS[0], fwd_hooks=[("blocks.0.hook_resid_post", steer)])
    assert steered.shape == plain.shape
    assert (steered - plain).abs().max() > 1e-2


@pytest.mark.parametrize("arch", ["granite_moe_shared", "ernie4_5_moe"])
def test_shared_and_routed_terms_sum_to_the_mlp_out(hooked, arch):
    _, cache = hooked(arch).run_with_cache(PROMPTS[0])
    shared, routed = cache["blocks.1.mlp.hook_shared_out"], cache["blocks.1.mlp.hook_routed_out"]
    torch.testing.assert_close(shared + routed, cache["blocks.1.hook_mlp_out"])


def test_granite_moe_shared_mlp_out_is_read_not_hooked(hooked):
    model = hooked("granite_moe_shared")
    with pytest.raises(Exception, match="mlp.hook_shared_out and mlp.hook_routed_out"):
        model.run_with_hooks(PROMPTS[0], fwd_hooks=[("blocks.1.hook_mlp_out", lambda x, hook: x)])


def test_ernie_dense_layers_keep_the_gated_mlp():
    config = AutoConfig.from_pretrained(tiny_model("ernie4_5_moe"))
    names = mapping_for(config).expanded(config)
    assert "blocks.0.mlp.hook_post" in names and "blocks.0.mlp.hook_router_logits" not in names
    assert "blocks.1.mlp.hook_router_logits" in names and "blocks.1.mlp.hook_post" not in names


def test_ernie_routing_is_vllms_with_the_bias():
    """The recomputed routing is vLLM's biased top-k (GPU: ``fused_topk_bias``; CPU: the grouped
    path with one group that vlens's patch puts the router on), and the bias changes choices."""
    from vllm.model_executor.layers.fused_moe.router.cpu_router import _grouped_topk

    config = AutoConfig.from_pretrained(tiny_model("ernie4_5_moe"))
    router = ernie4_5_moe.router(config).for_layer(1)
    torch.manual_seed(0)
    logits, bias = torch.randn(1, 500, 4), torch.randn(1, 4) * 0.2
    batch = Batch(
        mask=torch.ones(1, 500, dtype=torch.bool), weights={router.bias_name: bias},
        sampled=torch.zeros(1, 0), lengths=(500,),
    )
    weights, indices = router(logits, batch)
    theirs, their_indices = _grouped_topk(logits[0], 2, True, 1, 1, "softmax", 1.0, bias[0])
    by_expert, order = their_indices.long().argsort(-1), indices[0].argsort(-1)
    assert torch.equal(indices[0].gather(-1, order), their_indices.long().gather(-1, by_expert))
    torch.testing.assert_close(weights[0].gather(-1, order), theirs.gather(-1, by_expert))
    unbiased = logits[0].topk(2, dim=-1).indices.sort(-1).values
    assert not torch.equal(indices[0].sort(-1).values, unbiased)


def test_ernie_refuses_biases():
    config = ernie4_5_moe.tiny_config()
    config.use_bias = True
    with pytest.raises(NotImplementedError, match="use_bias=True"):
        ernie4_5_moe.hook_specs(config)


def test_unknown_expert_name_is_refused(hooked):
    with pytest.raises(UnknownHookName, match="one fused kernel"):
        hooked("granite_moe").run_with_cache("hi", names_filter="blocks.1.mlp.experts.3.hook_post")
