"""Mixtures of experts on vLLM's native Llama-family blocks (Qwen3-MoE, Mixtral, OLMoE,
Qwen2-MoE) and GPT-OSS: routing
recomputed as vLLM's CPU router does, TransformerLens's bridge on every name but the routing, which
names each layer has, and the refusal of one routed expert's names; GPT-OSS's refusals and
steering."""

from importlib import import_module

import pytest
import torch
from transformers import AutoConfig

from vlens.mappings import mapping_for
from vlens.mappings._moe import ROUTING_NAMES
from vlens.mappings.llama import BLOCK
from vlens.names.derived import Batch
from vlens.names.resolve import UnknownHookName
from vlens.parity.compare import FP32_MAX_REL, PROMPTS
from vlens.parity.reference import transformer_lens_reference
from vlens.parity.run import rows_against
from vlens.testing.tiny import tiny_model

ARCHS = ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "gpt_oss"]


def batch_of(positions: int) -> Batch:
    return Batch(
        mask=torch.ones(1, positions, dtype=torch.bool), weights={},
        sampled=torch.zeros(1, 0), lengths=(positions,),
    )


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routing_is_vllms(arch, dtype):
    """The recomputed routing picks the experts and weights vLLM's CPU router does, in the
    logits' dtype as vLLM computes it."""
    from vllm.model_executor.layers.fused_moe.router.cpu_router import _softmax_topk

    config = AutoConfig.from_pretrained(tiny_model(arch))
    ours = import_module(f"vlens.mappings.{arch}").router(config).for_layer(1)
    torch.manual_seed(0)
    logits = (torch.randn(1, 500, 4) * 3).to(dtype)
    our_weights, our_indices = ours(logits, batch_of(500))
    their_weights, their_indices = _softmax_topk(logits[0], ours.top_k, ours.renormalize)
    by_expert = their_indices.long().argsort(dim=-1)
    order = our_indices[0].argsort(dim=-1)
    assert torch.equal(our_indices[0].gather(-1, order), their_indices.long().gather(-1, by_expert))
    assert our_weights.dtype == torch.float32
    their_weights = their_weights.gather(-1, by_expert)
    torch.testing.assert_close(our_weights[0].gather(-1, order), their_weights)
    assert (our_weights[0, :, :-1] >= our_weights[0, :, 1:]).all(), "best expert first"


@pytest.mark.parametrize(("arch", "renormalized"), [("mixtral", True), ("olmoe", False)])
def test_renormalization_is_the_familys(arch, renormalized):
    """Mixtral's weights always sum to one; OLMoE's never do (vLLM ignores norm_topk_prob)."""
    config = AutoConfig.from_pretrained(tiny_model(arch))
    router = import_module(f"vlens.mappings.{arch}").router(config)
    weights, _ = router(torch.randn(1, 50, 4) * 3, batch_of(50))
    sums_to_one = torch.allclose(weights.sum(-1), torch.ones(1, 50))
    assert sums_to_one == renormalized


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_dense_and_moe_layers_have_their_own_names(arch):
    """The Qwen MoE models' ``mlp_only_layers`` keep the dense MLP and have no routing names."""
    config = AutoConfig.from_pretrained(tiny_model(arch))
    names = mapping_for(config).expanded(config)
    assert config.mlp_only_layers == [0]
    assert "blocks.0.mlp.hook_post" in names and "blocks.0.mlp.hook_router_logits" not in names
    assert "blocks.1.mlp.hook_router_logits" in names and "blocks.1.mlp.hook_post" not in names


@pytest.mark.parametrize("arch", ["mixtral", "olmoe"])
def test_every_layer_is_a_moe_layer(arch):
    config = AutoConfig.from_pretrained(tiny_model(arch))
    names = mapping_for(config).expanded(config)
    for layer in range(config.num_hidden_layers):
        assert {n.format(layer=layer) for n in ROUTING_NAMES} <= set(names)
        assert f"blocks.{layer}.mlp.hook_pre" not in names


@pytest.mark.parametrize("arch", ARCHS)
def test_every_other_name_matches_the_bridge(hooked, arch):
    """The bridge boots on these models; every name it has but the routing ones matches it
    (the routing ones are compared with HuggingFace in test_parity.py)."""
    model = hooked(arch)
    prompts = model.token_lists(list(PROMPTS))
    for new_tokens in (0, 3):
        _, cache = model.run_with_cache(prompts, max_new_tokens=new_tokens)
        sequences = [cache.tokens[i, : int(n)].tolist() for i, n in enumerate(cache.lengths)]
        names = [n for n in cache.keys() if not n.endswith(("expert_weights", "expert_indices"))]
        ours = [{n: cache.unpadded(n, i) for n in names} for i in range(len(prompts))]
        theirs = transformer_lens_reference(tiny_model(arch), sequences, names)
        assert theirs is not None
        rows = rows_against("TransformerLens", str(new_tokens), ours, theirs)
        covered = {row.name for row in rows}
        assert {"blocks.1.attn.hook_rot_q", "blocks.1.hook_mlp_out", "unembed.hook_out"} <= covered
        failures = [row for row in rows if not row.within(FP32_MAX_REL)]
        assert not failures, failures


@pytest.mark.parametrize("arch", ARCHS)
def test_bridge_routing_is_ours_scattered(hooked, bridge, arch):
    """What the bridge's routing hooks hold: per token (no batch axis), the chosen experts and
    their weights scattered over all experts: our ``[pos, top_k]`` values laid out its way."""
    model = hooked(arch)
    tokens = model.token_lists([PROMPTS[0]])[0]
    _, cache = model.run_with_cache([tokens])
    _, theirs = bridge(arch).run_with_cache(torch.tensor([tokens]))
    weights = cache["blocks.1.mlp.hook_expert_weights"][0]
    indices = cache["blocks.1.mlp.hook_expert_indices"][0]
    scattered = torch.zeros(len(tokens), 4).scatter(-1, indices, weights)
    torch.testing.assert_close(theirs["blocks.1.mlp.hook_expert_weights"], scattered)
    assert torch.equal(theirs["blocks.1.mlp.hook_expert_indices"].long(), indices)


@pytest.mark.parametrize("arch", ARCHS)
def test_asking_for_one_routed_expert_says_why(arch):
    config = AutoConfig.from_pretrained(tiny_model(arch))
    unavailable = mapping_for(config).unavailable
    message = unavailable("blocks.1.mlp.experts.3.hook_post")
    assert message is not None and "one fused kernel" in message
    assert "blocks.1.mlp.hook_expert_weights" in message and "blocks.1.hook_mlp_out" in message
    assert unavailable(f"{BLOCK}.mlp.hook_expert_indices".format(layer=1)) is None


def test_hooking_one_routed_expert_is_refused(hooked):
    model = hooked("mixtral")
    with pytest.raises(UnknownHookName) as error:
        model.run_with_cache("hi", names_filter="blocks.1.mlp.experts.3.hook_post")
    assert "one fused kernel" in str(error.value)


@pytest.mark.parametrize("arch", ARCHS)
def test_weights_match_the_bridge(bridge, arch):
    """Every weight view but the MLP's matches the bridge's; a MoE layer has no single W_in,
    W_gate or W_out, which the views say (the bridge has none either)."""
    from test_model_views import MODEL_VIEWS, CheckpointOnly, assert_same, read

    model, theirs = CheckpointOnly(tiny_model(arch)), bridge(arch)
    mlp_views = {"W_in", "W_gate", "W_out", "b_in", "b_out"}
    for attr in [view for view in MODEL_VIEWS if view not in mlp_views]:
        assert_same(attr, read(model, attr), read(theirs, attr))
    for layer in range(model.cfg.n_layers):
        for part, attrs in [("attn", ["W_Q", "W_K", "W_V", "W_O", "b_Q", "b_O"]), ("ln1", ["w"]),
                            ("ln2", ["w"])]:
            for attr in attrs:
                label = f"blocks.{layer}.{part}.{attr}"
                ours = getattr(model.blocks[layer], part)
                their = getattr(theirs.blocks[layer], part)
                assert_same(label, read(ours, attr), read(their, attr))
    assert_same("unembed.W_U", model.unembed.W_U, theirs.unembed.W_U)
    assert_same("ln_final.w", model.ln_final.w, theirs.ln_final.w)
    with pytest.raises(NotImplementedError, match="W_in is not available"):
        _ = model.blocks[1].mlp.W_in
    assert isinstance(read(theirs.blocks[1].mlp, "W_in"), AttributeError)


def test_shared_and_routed_parts_sum_to_the_mlp_out(hooked):
    """Qwen2-MoE: the gated shared expert and the routed experts are the MoE block's two terms;
    the gate weighs the shared expert by a weight in (0, 1)."""
    _, cache = hooked("qwen2_moe").run_with_cache(PROMPTS[0])
    shared, routed = cache["blocks.1.mlp.hook_shared_out"], cache["blocks.1.mlp.hook_routed_out"]
    torch.testing.assert_close(shared + routed, cache["blocks.1.hook_mlp_out"])
    gate = cache["blocks.1.mlp.hook_shared_gate"]
    assert gate.shape[-1] == 1 and ((gate > 0) & (gate < 1)).all()
    assert "blocks.0.mlp.hook_shared_out" not in cache.keys()


@pytest.mark.parametrize(
    ("setting", "value"),
    [("rms_norm_eps", 1e-6), ("swiglu_limit", 5.0), ("swiglu_alpha", 1.0),
     ("tie_word_embeddings", True), ("attention_bias", False),
     ("layer_types", ["full_attention", "sliding_attention", "sliding_attention"])],
)
def test_gpt_oss_configs_vllm_computes_otherwise_are_refused(setting, value):
    from vlens.mappings import gpt_oss

    config = AutoConfig.from_pretrained(tiny_model("gpt_oss"))
    gpt_oss.check_served(config)
    setattr(config, setting, value)
    with pytest.raises(NotImplementedError, match=setting):
        gpt_oss.check_served(config)


def test_gpt_oss_mxfp4_checkpoints_are_refused_on_the_cpu():
    from vlens.mappings import gpt_oss

    config = AutoConfig.from_pretrained(tiny_model("gpt_oss"))
    config.quantization_config = {"quant_method": "mxfp4"}
    with pytest.raises(NotImplementedError, match="MXFP4.*unquantized copy"):
        gpt_oss.check_served(config)


def test_gpt_oss_steering_and_sinks(hooked):
    """A residual edit changes the logits; patterns keep the sink's share out (rows sum to less
    than one); hooks on patterns say why they cannot run."""
    model = hooked("gpt_oss")
    tokens = model.token_lists([PROMPTS[2]])
    plain, cache = model.run_with_cache(tokens)
    steered = model.run_with_hooks(
        tokens, fwd_hooks=[("blocks.0.hook_resid_post", lambda resid, hook: resid + 4.0)]
    )
    assert (steered - plain).abs().max() > 0.1
    sums = cache["blocks.1.attn.hook_pattern"].sum(-1)
    assert (sums < 1 - 1e-3).all() and (sums > 0).all()
    with pytest.raises(Exception, match="sinks"):
        model.run_with_hooks(tokens, fwd_hooks=[("blocks.1.attn.hook_pattern", lambda p, hook: p)])
