"""DeepSeek-V2/V3: multi-head latent attention and mixture-of-experts names (their parity with
HuggingFace is in ``test_parity.py``)."""

import pytest
import torch
from transformers import AutoConfig, DeepseekV3Config

from vlens.mappings.deepseek import routed_expert_error, router, softmax_scale
from vlens.names.derived import Batch
from vlens.names.resolve import UnknownHookName
from vlens.testing.tiny import tiny_model

ARCHS = ["deepseek_v3", "deepseek_v2"]


@pytest.mark.parametrize("arch", ARCHS)
def test_dense_and_moe_layers_have_their_own_names(arch):
    from vlens.mappings import mapping_for

    config = AutoConfig.from_pretrained(tiny_model(arch))
    names = mapping_for(config).expanded(config)
    assert config.first_k_dense_replace == 1
    assert "blocks.0.mlp.hook_post" in names and "blocks.0.mlp.hook_router_logits" not in names
    assert "blocks.1.mlp.hook_router_logits" in names and "blocks.1.mlp.hook_post" not in names
    assert ("blocks.0.attn.hook_q_latent" in names) == (config.q_lora_rank is not None)
    assert not [name for name in names if ".experts." in name]


def test_routed_expert_names_are_explained():
    message = routed_expert_error("blocks.1.mlp.experts.3.hook_post")
    assert message is not None
    assert "one fused kernel" in message
    assert "blocks.1.mlp.hook_expert_weights" in message and "blocks.1.hook_mlp_out" in message
    assert routed_expert_error("mlp.experts.0.hook_pre") is not None
    assert routed_expert_error("blocks.1.mlp.hook_expert_indices") is None
    assert routed_expert_error("blocks.1.mlp.shared_experts.hook_post") is None


def test_asking_for_one_routed_expert_says_why(hooked):
    model = hooked("deepseek_v3")
    with pytest.raises(UnknownHookName) as error:
        model.run_with_cache("hi", names_filter="blocks.1.mlp.experts.3.hook_post")
    assert "one fused kernel" in str(error.value)


@pytest.mark.parametrize("arch", ARCHS)
def test_routing_is_vllms(arch):
    """The recomputed routing picks the experts and weights vLLM's CPU router does."""
    from vllm.model_executor.layers.fused_moe.router.cpu_router import _grouped_topk

    config = AutoConfig.from_pretrained(tiny_model(arch))
    ours = router(config).for_layer(1)
    torch.manual_seed(0)
    logits = torch.randn(1, 500, config.n_routed_experts) * 3
    bias = torch.randn(config.n_routed_experts) * 0.3
    weights = {ours.bias_name: bias} if ours.bias_name else {}
    batch = Batch(
        mask=torch.ones(1, 500, dtype=torch.bool), weights=weights, sampled=torch.zeros(1, 0),
        lengths=(500,),
    )
    our_weights, our_indices = ours(logits, batch)
    their_weights, their_indices = _grouped_topk(
        logits[0], ours.top_k, ours.renormalize, ours.n_group, ours.topk_group, ours.scoring,
        ours.scaling, bias if ours.bias_name else None,
    )
    by_expert = their_indices.long().argsort(dim=-1)
    order = our_indices[0].argsort(dim=-1)
    assert torch.equal(our_indices[0].gather(-1, order), their_indices.long().gather(-1, by_expert))
    their_weights = their_weights.gather(-1, by_expert)
    torch.testing.assert_close(our_weights[0].gather(-1, order), their_weights)


@pytest.mark.parametrize("mscale_all_dim", [0.0, 1.0])
def test_softmax_scale_follows_yarn_as_huggingface_does(mscale_all_dim):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    config = DeepseekV3Config(
        hidden_size=128, num_attention_heads=4, q_lora_rank=64, kv_lora_rank=512,
        qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0,
            "mscale_all_dim": mscale_all_dim, "original_max_position_embeddings": 4096,
        },
    )
    assert softmax_scale(config) == pytest.approx(DeepseekV3Attention(config, 0).scaling)
