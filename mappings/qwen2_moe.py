"""Qwen2-MoE / Qwen1.5-MoE (``Qwen2MoeForCausalLM``) as vLLM builds it: Qwen2's decoder layer and
attention (``qwen2.py``: Llama's with q/k/v biases) with a mixture of experts and a gated shared
expert as the MLP of its MoE layers (``model.layers.{layer}.mlp``, see ``_moe.py``)::

    router_logits, _ = gate(hidden)              # mlp.hook_router_logits [pos, n_routed_experts]
    experts(hidden, router_logits):              # one fused kernel, which also runs
        shared = shared_expert(hidden):          #   the shared expert (a module: its output is
            out = down_proj(act(gate_up_proj(x)))  #   mlp.hook_shared_out)
            g = shared_expert_gate(x)[0]         # mlp.hook_shared_gate = sigmoid(g) [pos, 1]
            return sigmoid(g) * out
        return shared + routed                   # hook_mlp_out; mlp.hook_routed_out = routed

``mlp.hook_shared_gate`` is the weight the shared expert's output gets (the gate's sigmoid), the
one term a per-token logit would lack (rounding alone moves a logit near zero by a large fraction
of itself). Routing is plain softmax top-k, renormalized where ``norm_topk_prob``
(:class:`~vlens.mappings._moe.SoftmaxTopK`). Layers listed in ``mlp_only_layers``, or off the
``decoder_sparse_step`` grid, keep the dense gated MLP, as in Qwen3-MoE.
"""

from transformers import PretrainedConfig, Qwen2MoeConfig

from vlens.mappings import qwen2
from vlens.mappings._moe import ROUTING_NAMES, SoftmaxTopK, moe_member, sigmoid, with_experts
from vlens.mappings._tiny import rotary_dims
from vlens.mappings.llama import BLOCK, MLP
from vlens.mappings.qwen3_moe import is_moe_layer
from vlens.names.mapping import PartialSums, Spec, difference, inserted_before, leaving

SHARED_NAMES = tuple(
    f"{BLOCK}.mlp.hook_{n}" for n in ("shared_gate", "shared_out", "routed_out")
)
MOE_NAMES = (*ROUTING_NAMES, *SHARED_NAMES)


def router(config: PretrainedConfig) -> SoftmaxTopK:
    """The routing vLLM builds for ``Qwen2MoeSparseMoeBlock``."""
    return SoftmaxTopK(top_k=config.num_experts_per_tok, renormalize=bool(config.norm_topk_prob))


def hook_specs(config: PretrainedConfig) -> dict[str, Spec]:
    specs = with_experts(qwen2.MAPPING.hook_specs(config), MLP, router(config), keep_dense=True)
    if not config.shared_expert_intermediate_size:  # vLLM then builds no shared expert
        return specs
    shared = {
        SHARED_NAMES[0]: sigmoid(leaving(f"{MLP}.shared_expert_gate", element=0, shape="pos 1")),
        # Under TP vLLM builds the shared expert with reduce_results=False: each rank holds a
        # partial sum of its output until the block's one all-reduce.
        SHARED_NAMES[1]: leaving(f"{MLP}.shared_expert", shards=PartialSums()),
        SHARED_NAMES[2]: difference(f"{BLOCK}.hook_mlp_out", SHARED_NAMES[1]),
    }
    return inserted_before(specs, f"{BLOCK}.hook_mlp_out", shared)


def tiny_config() -> PretrainedConfig:
    """Qwen2-MoE: a dense first layer (``mlp_only_layers``), then 4 experts of 64, top-2, not
    renormalized (Qwen1.5-MoE's setting), and a shared expert of 128 behind its sigmoid gate."""
    return Qwen2MoeConfig(
        **rotary_dims(),
        rms_norm_eps=1e-6,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=128,
        decoder_sparse_step=1,
        mlp_only_layers=[0],
        norm_topk_prob=False,
        tie_word_embeddings=False,
    )


MAPPING = moe_member(
    qwen2.MAPPING,
    "Qwen2MoeForCausalLM",
    hook_specs=hook_specs,
    tiny_configs={"qwen2_moe": tiny_config},
    moe_names=MOE_NAMES,
    is_moe_layer=is_moe_layer,
)
