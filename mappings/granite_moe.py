"""GraniteMoe (``GraniteMoeForCausalLM``) as vLLM builds it: Granite's decoder (``granite.py``: the
four multipliers, a plain residual) with Mixtral's mixture of experts as every layer's MLP, under
``model.layers.{layer}.block_sparse_moe`` (see ``_moe.py``). The model and one layer::

    hidden = embed_tokens(ids); hidden *= embedding_multiplier   # in place: hook_embed
    residual = hidden                                             # resid_pre
    attn = self_attn(positions, input_layernorm(hidden))          # scores · attention_multiplier
    hidden = residual + attn * residual_multiplier                # resid_mid
    residual = hidden
    block_sparse_moe(post_attention_layernorm(hidden)):
        router_logits, _ = gate(x)             # mlp.hook_router_logits [pos, n_routed_experts]
        moe = experts(x, router_logits)        # routing, every expert, the weighted sum
    hidden = residual + moe * residual_multiplier                 # hook_mlp_out = moe · multiplier
    hidden = norm(hidden)                                         # logits: lm_head / logits_scaling

Names carry Granite's meaning (its docstring): ``hook_embed`` the scaled embedding,
``hook_attn_out``, ``hook_result`` and ``hook_mlp_out`` the terms the residual stream receives,
scaled by ``residual_multiplier``, scores scaled by ``attention_multiplier``, logits divided by
``logits_scaling``. vLLM always renormalizes the chosen experts' weights, as HuggingFace's router
does: softmax over the ``top_k`` best logits (:class:`~vlens.mappings._moe.SoftmaxTopK`).

Refused: ``attention_bias=True`` (HuggingFace adds biases to q, k, v and o; vLLM builds those
projections without one, so every name from the attention on would differ; only checkpoints
without attention biases are served), and a ``head_dim`` other than ``hidden_size /
num_attention_heads`` (vLLM always splits ``hidden_size`` evenly over the heads).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import GraniteMoeConfig, PretrainedConfig

from vlens.mappings import granite
from vlens.mappings._moe import SoftmaxTopK, moe_member, with_experts
from vlens.mappings._tiny import rotary_dims
from vlens.mappings.llama import BLOCK, LAYER
from vlens.names.mapping import ArchitectureMapping, Spec, leaving

MOE = f"{LAYER}.block_sparse_moe"


def served(config: PretrainedConfig) -> None:
    """Raise where vLLM's GraniteMoe modules would compute something else than HuggingFace's."""
    if getattr(config, "attention_bias", False):
        raise NotImplementedError(
            "this GraniteMoe checkpoint has attention biases (attention_bias=True), which "
            "HuggingFace adds to q, k, v and o and vLLM's GraniteMoe attention omits; vLLM's "
            "model would need qkv_proj and o_proj built with bias=True to serve it"
        )
    head_dim = getattr(config, "head_dim", None)
    if head_dim is not None and head_dim != config.hidden_size // config.num_attention_heads:
        raise NotImplementedError(
            f"this checkpoint's head_dim ({head_dim}) is not hidden_size / num_attention_heads, "
            f"which vLLM's GraniteMoe attention always uses; it would need vLLM to read head_dim"
        )


def router(config: PretrainedConfig) -> SoftmaxTopK:
    """The routing vLLM builds for ``GraniteMoeMoE`` (``renormalize=True``)."""
    return SoftmaxTopK(top_k=config.num_experts_per_tok, renormalize=True)


def hook_specs(config: PretrainedConfig) -> dict[str, Spec]:
    served(config)
    specs = with_experts(granite.hook_specs(config), MOE, router(config))
    specs[f"{BLOCK}.hook_mlp_out"] = granite.scaled(leaving(MOE), config.residual_multiplier)
    return specs


def tiny_config() -> PretrainedConfig:
    """GraniteMoe: 4 experts of 64 (``intermediate_size``), top-2; Granite's multipliers away from
    1 (as ``granite.py``'s tiny config), tied embeddings."""
    return GraniteMoeConfig(
        **{**rotary_dims(), "intermediate_size": 64},
        num_local_experts=4,
        num_experts_per_tok=2,
        rms_norm_eps=1e-5,
        embedding_multiplier=4.0,
        residual_multiplier=0.5,
        attention_multiplier=0.25,
        logits_scaling=2.0,
        pad_token_id=None,
        tie_word_embeddings=True,
    )


def granite_member(architecture: str, **differences: Any) -> ArchitectureMapping:
    """A MoE member of Granite: ``moe_member``'s fields, with Granite's weights (scaled logits);
    its HuggingFace reference is ``parity/hf_decoder_moe.py``."""
    bridge = differences.pop("no_bridge_reference", None)
    member = moe_member(granite.MAPPING, architecture, **differences)
    member = dataclasses.replace(member, hf_recorder="hf_decoder_moe")
    return member if bridge is None else dataclasses.replace(member, no_bridge_reference=bridge)


MAPPING = granite_member(
    "GraniteMoeForCausalLM",
    hook_specs=hook_specs,
    tiny_configs={"granite_moe": tiny_config},
)
