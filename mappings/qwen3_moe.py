"""Qwen3-MoE (``Qwen3MoeForCausalLM``) as vLLM builds it: Qwen3's decoder layer and attention
(``qwen3.py``: Llama's fused residual, per-head q/k norms) with a mixture of experts as the MLP of
its MoE layers (``model.layers.{layer}.mlp``, see ``_moe.py``)::

    router_logits, _ = gate(hidden)          # mlp.hook_router_logits [pos, n_routed_experts]
    return experts(hidden, router_logits)    # hook_mlp_out: routing, every expert, the weighted sum

vLLM hands ``gate`` to the fused MoE layer, which calls it as a module before routing, so its
output is still read. Routing is plain softmax top-k (``norm_topk_prob``: renormalized over the
chosen experts), :class:`~vlens.mappings._moe.SoftmaxTopK`. Layers listed in ``mlp_only_layers``,
or off the ``decoder_sparse_step`` grid, keep Qwen3's dense gated MLP (``mlp.hook_pre``,
``hook_pre_linear``, ``hook_post``) and have no routing names.
"""

from transformers import PretrainedConfig, Qwen3MoeConfig

from vlens.mappings import qwen3
from vlens.mappings._moe import SoftmaxTopK, moe_member, with_experts
from vlens.mappings._tiny import rotary_dims
from vlens.mappings.llama import MLP
from vlens.names.mapping import Spec


def is_moe_layer(config: PretrainedConfig, layer: int) -> bool:
    """vLLM's rule (``Qwen3MoeDecoderLayer``)."""
    return (
        layer not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (layer + 1) % config.decoder_sparse_step == 0
    )


def router(config: PretrainedConfig) -> SoftmaxTopK:
    """The routing vLLM builds for ``Qwen3MoeSparseMoeBlock``."""
    return SoftmaxTopK(top_k=config.num_experts_per_tok, renormalize=bool(config.norm_topk_prob))


def hook_specs(config: PretrainedConfig) -> dict[str, Spec]:
    return with_experts(qwen3.hook_specs(config), MLP, router(config), keep_dense=True)


def tiny_config() -> PretrainedConfig:
    """Qwen3-MoE: a dense first layer (``mlp_only_layers``), then 4 experts of 64, top-2,
    renormalized."""
    return Qwen3MoeConfig(
        **rotary_dims(),
        head_dim=32,
        rms_norm_eps=1e-6,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        decoder_sparse_step=1,
        mlp_only_layers=[0],
        norm_topk_prob=True,
        tie_word_embeddings=False,
    )


MAPPING = moe_member(
    qwen3.MAPPING,
    "Qwen3MoeForCausalLM",
    hook_specs=hook_specs,
    tiny_configs={"qwen3_moe": tiny_config},
    is_moe_layer=is_moe_layer,
)
