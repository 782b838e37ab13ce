"""Mixtral (``MixtralForCausalLM``) as vLLM builds it: Llama's decoder layer and attention
(``llama.py``, sliding window included) with a mixture of experts as every layer's MLP, under
vLLM's own name ``model.layers.{layer}.block_sparse_moe`` (see ``_moe.py``)::

    router_logits, _ = gate(hidden)          # mlp.hook_router_logits [pos, n_routed_experts]
    return experts(hidden, router_logits)    # hook_mlp_out: routing, every expert, the weighted sum

vLLM always renormalizes the chosen experts' weights (Mixtral's config has no
``norm_topk_prob``): softmax over the ``top_k`` best logits,
:class:`~vlens.mappings._moe.SoftmaxTopK`.
"""

from transformers import MixtralConfig, PretrainedConfig

from vlens.mappings import llama
from vlens.mappings._moe import SoftmaxTopK, moe_member, with_experts
from vlens.mappings._tiny import rotary_dims
from vlens.mappings.llama import LAYER
from vlens.names.mapping import Spec

MOE = f"{LAYER}.block_sparse_moe"


def router(config: PretrainedConfig) -> SoftmaxTopK:
    """The routing vLLM builds for ``MixtralMoE``."""
    return SoftmaxTopK(top_k=config.num_experts_per_tok, renormalize=True)


def hook_specs(config: PretrainedConfig) -> dict[str, Spec]:
    return with_experts(llama.hook_specs(config), MOE, router(config))


def tiny_config() -> PretrainedConfig:
    """Mixtral: 4 experts of 64 (``intermediate_size``), top-2; untied unembedding; no sliding
    window."""
    return MixtralConfig(
        **{**rotary_dims(), "intermediate_size": 64},
        num_local_experts=4,
        num_experts_per_tok=2,
        rms_norm_eps=1e-5,
        sliding_window=None,
        tie_word_embeddings=False,
    )


MAPPING = moe_member(
    llama.MAPPING,
    "MixtralForCausalLM",
    hook_specs=hook_specs,
    tiny_configs={"mixtral": tiny_config},
)
