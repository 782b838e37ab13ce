"""GraniteMoeShared (``GraniteMoeSharedForCausalLM``) as vLLM builds it: GraniteMoe
(``granite_moe.py``) with a shared MLP beside the mixture of experts of every layer, outside the
MoE block (``model.layers.{layer}.shared_mlp``). What differs in one layer::

    x = post_attention_layernorm(hidden)
    moe = block_sparse_moe(x.clone())          # router and experts, as GraniteMoe's
    shared = shared_mlp(x):                    # ungated sum, no gate on its output
        out = output_linear(silu(gate) * up)   #   [gate | up] = input_linear(x)
    hidden = residual + (moe + shared) * residual_multiplier

``mlp.hook_routed_out`` (``block_sparse_moe``'s output) and ``mlp.hook_shared_out``
(``shared_mlp``'s) are the two terms the residual stream receives, each scaled by
``residual_multiplier`` as Granite's ``hook_mlp_out`` is, so that ``hook_mlp_out`` is their sum.
vLLM adds them in the layer's forward, where no module returns the sum: ``hook_mlp_out`` is
computed from the two terms after the forward, and a hook function on it is refused with the
names to hook instead (either term, or ``hook_resid_post``). A checkpoint with
``shared_intermediate_size=0`` has no shared MLP: its names are GraniteMoe's.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor
from transformers import GraniteMoeSharedConfig, PretrainedConfig

from vlens.mappings import granite, granite_moe
from vlens.mappings._moe import ROUTING_NAMES
from vlens.mappings._tiny import rotary_dims
from vlens.mappings.llama import BLOCK, LAYER
from vlens.names.derived import Batch, SameForEveryLayer
from vlens.names.mapping import DerivedSpec, NoExplicitAttention, Spec, inserted_before, leaving

SHARED_NAMES = (f"{BLOCK}.mlp.hook_shared_out", f"{BLOCK}.mlp.hook_routed_out")


@dataclass(frozen=True)
class Sum(SameForEveryLayer):
    """The sources added (the MoE's output from its two terms)."""

    def __call__(self, sources: list[Tensor], batch: Batch) -> Tensor:
        return sum(sources[1:], sources[0])


def hook_specs(config: PretrainedConfig) -> dict[str, Spec]:
    specs = granite_moe.hook_specs(config)
    if not getattr(config, "shared_intermediate_size", 0):  # vLLM then builds no shared MLP
        return specs
    multiplier = config.residual_multiplier
    terms = {
        SHARED_NAMES[0]: granite.scaled(leaving(f"{LAYER}.shared_mlp"), multiplier),
        SHARED_NAMES[1]: granite.scaled(leaving(granite_moe.MOE), multiplier),
    }
    specs = inserted_before(specs, f"{BLOCK}.hook_mlp_out", terms)
    specs[f"{BLOCK}.hook_mlp_out"] = DerivedSpec(
        SHARED_NAMES,
        Sum(),
        "pos d_model",
        hookable=NoExplicitAttention(
            "GraniteMoeShared's MLP output is the sum of the shared MLP's and the experts' "
            "outputs, which vLLM adds in the layer's forward where no module returns it; hook "
            "mlp.hook_shared_out and mlp.hook_routed_out (its two terms) or hook_resid_post"
        ),
    )
    return specs


def tiny_config() -> PretrainedConfig:
    """GraniteMoeShared: GraniteMoe's tiny config and a shared MLP of 128."""
    return GraniteMoeSharedConfig(
        **{**rotary_dims(), "intermediate_size": 64},
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=128,
        rms_norm_eps=1e-5,
        embedding_multiplier=4.0,
        residual_multiplier=0.5,
        attention_multiplier=0.25,
        logits_scaling=2.0,
        pad_token_id=None,
        tie_word_embeddings=True,
    )


MAPPING = granite_moe.granite_member(
    "GraniteMoeSharedForCausalLM",
    hook_specs=hook_specs,
    tiny_configs={"granite_moe_shared": tiny_config},
    moe_names=(*ROUTING_NAMES, *SHARED_NAMES),
    no_bridge_reference=(
        "TransformerLens 4.3 has no architecture adapter for GraniteMoeSharedForCausalLM "
        "(its bridge refuses the checkpoint)"
    ),
)
